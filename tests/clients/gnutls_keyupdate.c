/*
 * An NBD client over GnuTLS that updates its TLS 1.3 keys mid-session,
 * for nbdgw's key update tests (tests/key_update.rs compiles it with
 * `cc $(pkg-config --cflags --libs gnutls)`).
 *
 *   gnutls_keyupdate HOST PORT CAFILE CERTFILE KEYFILE EXPORT MODE [REQUESTS]
 *
 * Fixed-newstyle handshake in plaintext, NBD_OPT_STARTTLS, a TLS 1.3
 * handshake with a client certificate (the server is verified against
 * CAFILE as "localhost"), NBD_OPT_GO for EXPORT with simple replies, then:
 *
 *   none    write a pattern, read it back; again; no key update
 *   ku0     the same, with gnutls_session_key_update(session, 0) between
 *   kupeer  the same, with GNUTLS_KU_PEER (asking the server to update
 *           its keys too); fails unless the server's KeyUpdate arrives
 *           within a few round trips
 *   long    REQUESTS 512-byte reads at queue depth 1 over a written
 *           pattern, every byte compared
 *
 * Every mode prints "server rekeys: K" (KeyUpdate messages received from
 * the server, each confirmed by a change of the read key) and ends with
 * NBD_CMD_DISC and gnutls_bye. Exit 0 only if every byte compared equal;
 * any failure: a message on stderr and exit 1 (2: usage).
 */
#include <errno.h>
#include <gnutls/gnutls.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define IO_TIMEOUT_SECS 20
#define SERVER_NAME "localhost"

#define NBDMAGIC 0x4e42444d41474943ULL
#define IHAVEOPT 0x49484156454f5054ULL
#define OPT_REPLY_MAGIC 0x0003e889045565a9ULL
#define REQUEST_MAGIC 0x25609513U
#define SIMPLE_REPLY_MAGIC 0x67446698U
#define FLAG_FIXED_NEWSTYLE 1U
#define FLAG_NO_ZEROES 2U
#define OPT_STARTTLS 5U
#define OPT_GO 7U
#define REP_ACK 1U
#define REP_INFO 3U
#define REP_FLAG_ERROR 0x80000000U
#define INFO_EXPORT 0
#define TFLAG_READ_ONLY 2
#define CMD_READ 0
#define CMD_WRITE 1
#define CMD_DISC 2

/* The region the client writes and reads back: away from offset 0, and
 * larger than one TLS record so writes span several. */
#define REGION_OFFSET 65536ULL
#define REGION_LEN (64 * 1024)
#define LONG_READ_LEN 512

static const char *phase = "start";

static void die(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "gnutls_keyupdate: %s: ", phase);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(1);
}

static double now_secs(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void put_u16(uint8_t *p, uint16_t v)
{
	p[0] = v >> 8;
	p[1] = v;
}

static void put_u32(uint8_t *p, uint32_t v)
{
	put_u16(p, v >> 16);
	put_u16(p + 2, v);
}

static void put_u64(uint8_t *p, uint64_t v)
{
	put_u32(p, v >> 32);
	put_u32(p + 4, v);
}

static uint16_t get_u16(const uint8_t *p)
{
	return (uint16_t)(p[0] << 8 | p[1]);
}

static uint32_t get_u32(const uint8_t *p)
{
	return (uint32_t)get_u16(p) << 16 | get_u16(p + 2);
}

static uint64_t get_u64(const uint8_t *p)
{
	return (uint64_t)get_u32(p) << 32 | get_u32(p + 4);
}

/* Deterministic bytes, none zero, different for every (seed, position). */
static void fill_pattern(uint8_t *buf, size_t len, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ULL | 1;
	for (size_t i = 0; i < len; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = (uint8_t)x | 1;
	}
}

static void compare(const uint8_t *got, const uint8_t *want, size_t len,
		    uint64_t offset)
{
	for (size_t i = 0; i < len; i++)
		if (got[i] != want[i])
			die("data mismatch at offset %llu: read 0x%02x, wrote 0x%02x",
			    (unsigned long long)(offset + i), got[i], want[i]);
}

/* ---- plaintext phase ---- */

static void plain_read(int fd, void *buf, size_t len)
{
	uint8_t *p = buf;
	while (len > 0) {
		ssize_t n = recv(fd, p, len, 0);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
		} else if (n == 0) {
			die("server closed the connection");
		} else if (errno == EAGAIN || errno == EWOULDBLOCK) {
			die("timed out after %d s", IO_TIMEOUT_SECS);
		} else if (errno != EINTR) {
			die("recv: %s", strerror(errno));
		}
	}
}

static void plain_write(int fd, const void *buf, size_t len)
{
	const uint8_t *p = buf;
	while (len > 0) {
		ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
		} else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			die("send timed out after %d s", IO_TIMEOUT_SECS);
		} else if (n < 0 && errno != EINTR) {
			die("send: %s", strerror(errno));
		}
	}
}

/* ---- TLS phase ---- */

struct client {
	gnutls_session_t session;
	/* KeyUpdate messages received from the server, counted by the
	 * handshake hook; and how many of them came with request_update set. */
	unsigned server_key_updates;
	unsigned server_update_requests;
	/* The read key and IV as last seen, to confirm each KeyUpdate. */
	uint8_t read_key[128];
	unsigned read_key_len;
	unsigned read_key_changes;
	uint64_t cookie;
	uint64_t export_size;
	uint16_t transmission_flags;
};

static struct client *hook_client;

static int key_update_hook(gnutls_session_t session, unsigned htype,
			   unsigned when, unsigned incoming,
			   const gnutls_datum_t *msg)
{
	(void)session;
	(void)when;
	if (htype == GNUTLS_HANDSHAKE_KEY_UPDATE && incoming) {
		hook_client->server_key_updates++;
		if (msg->size == 1 && msg->data[0] == 1)
			hook_client->server_update_requests++;
	}
	return 0;
}

/* Copies the current key and IV of one direction (1: read, 0: write) into
 * buf; gnutls_record_get_state() points into the session's epoch, which a
 * key update frees, so the bytes are copied at once. */
static unsigned record_key(struct client *c, unsigned read, uint8_t *buf,
			   size_t cap)
{
	gnutls_datum_t iv, key;
	unsigned char seq[8];
	int ret = gnutls_record_get_state(c->session, read, NULL, &iv, &key,
					  seq);
	if (ret < 0)
		die("gnutls_record_get_state: %s", gnutls_strerror(ret));
	if ((size_t)key.size + iv.size > cap)
		die("record key too long (%u + %u bytes)", key.size, iv.size);
	memcpy(buf, key.data, key.size);
	memcpy(buf + key.size, iv.data, iv.size);
	return key.size + iv.size;
}

/* Notes whether the read key changed since it was last looked at. */
static void track_read_key(struct client *c)
{
	uint8_t now[sizeof c->read_key];
	unsigned len = record_key(c, 1, now, sizeof now);
	if (len != c->read_key_len || memcmp(now, c->read_key, len) != 0) {
		if (c->read_key_len != 0)
			c->read_key_changes++;
		memcpy(c->read_key, now, len);
		c->read_key_len = len;
	}
}

static void tls_read(struct client *c, void *buf, size_t len)
{
	uint8_t *p = buf;
	double deadline = now_secs() + IO_TIMEOUT_SECS;
	/* GNUTLS_E_AGAIN also comes back, on a blocking socket, after a
	 * post-handshake message (NewSessionTicket, KeyUpdate): retried until
	 * the deadline; a socket that times out (SO_RCVTIMEO) takes it. */
	while (len > 0) {
		ssize_t n = gnutls_record_recv(c->session, p, len);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
		} else if (n == 0) {
			die("server ended the TLS session (close_notify) with %zu bytes still expected",
			    len);
		} else if (n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED) {
			if (now_secs() > deadline)
				die("timed out after %d s", IO_TIMEOUT_SECS);
		} else {
			die("gnutls_record_recv: %s (%zd)",
			    gnutls_strerror((int)n), n);
		}
	}
}

static void tls_write(struct client *c, const void *buf, size_t len)
{
	const uint8_t *p = buf;
	double deadline = now_secs() + IO_TIMEOUT_SECS;
	while (len > 0) {
		ssize_t n = gnutls_record_send(c->session, p, len);
		if (n > 0) {
			p += n;
			len -= (size_t)n;
		} else if (n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED) {
			/* Called again with the same data, as GnuTLS asks. */
			if (now_secs() > deadline)
				die("send timed out after %d s", IO_TIMEOUT_SECS);
		} else {
			die("gnutls_record_send: %s (%zd)",
			    gnutls_strerror((int)n), n);
		}
	}
}

/* ---- negotiation ---- */

static void send_option(int fd, struct client *c, uint32_t option,
			const uint8_t *data, uint32_t len)
{
	uint8_t h[16];
	put_u64(h, IHAVEOPT);
	put_u32(h + 8, option);
	put_u32(h + 12, len);
	if (c) {
		tls_write(c, h, sizeof h);
		if (len)
			tls_write(c, data, len);
	} else {
		plain_write(fd, h, sizeof h);
		if (len)
			plain_write(fd, data, len);
	}
}

/* One option reply; its data (up to cap bytes kept) in data. */
static uint32_t read_option_reply(int fd, struct client *c, uint32_t option,
				  uint8_t *data, size_t cap, uint32_t *len_out)
{
	uint8_t h[20];
	if (c)
		tls_read(c, h, sizeof h);
	else
		plain_read(fd, h, sizeof h);
	if (get_u64(h) != OPT_REPLY_MAGIC)
		die("bad option reply magic %016llx",
		    (unsigned long long)get_u64(h));
	if (get_u32(h + 8) != option)
		die("reply to option %u, expected %u", get_u32(h + 8), option);
	uint32_t type = get_u32(h + 12), len = get_u32(h + 16);
	if (len > 65536)
		die("option reply of %u bytes", len);
	uint8_t *buf = malloc(len ? len : 1);
	if (!buf)
		die("out of memory");
	if (c)
		tls_read(c, buf, len);
	else
		plain_read(fd, buf, len);
	size_t keep = len < cap ? len : cap;
	memcpy(data, buf, keep);
	free(buf);
	*len_out = len;
	return type;
}

static void starttls(int fd)
{
	uint8_t data[1024];
	uint32_t len;
	send_option(fd, NULL, OPT_STARTTLS, NULL, 0);
	uint32_t type = read_option_reply(fd, NULL, OPT_STARTTLS, data,
					  sizeof data - 1, &len);
	if (type != REP_ACK) {
		data[len < sizeof data - 1 ? len : sizeof data - 1] = 0;
		die("STARTTLS refused: reply type %#x: %s", type, data);
	}
}

static void go(int fd, struct client *c, const char *export)
{
	size_t name_len = strlen(export);
	uint8_t data[4 + 4096 + 2];
	if (name_len > 4096)
		die("export name too long");
	put_u32(data, (uint32_t)name_len);
	memcpy(data + 4, export, name_len);
	put_u16(data + 4 + name_len, 0);
	send_option(fd, c, OPT_GO, data, (uint32_t)(4 + name_len + 2));
	int have_export = 0;
	for (int i = 0; i < 64; i++) {
		uint8_t reply[1024];
		uint32_t len;
		uint32_t type = read_option_reply(fd, c, OPT_GO, reply,
						  sizeof reply - 1, &len);
		if (type == REP_ACK) {
			if (!have_export)
				die("GO acknowledged without NBD_INFO_EXPORT");
			return;
		}
		if (type & REP_FLAG_ERROR) {
			reply[len < sizeof reply - 1 ? len : sizeof reply - 1] = 0;
			die("GO refused: reply type %#x: %s", type, reply);
		}
		if (type == REP_INFO && len == 12 &&
		    get_u16(reply) == INFO_EXPORT) {
			c->export_size = get_u64(reply + 2);
			c->transmission_flags = get_u16(reply + 10);
			have_export = 1;
		}
	}
	die("GO: more than 64 replies");
}

/* ---- transmission ---- */

static void request(struct client *c, uint16_t command, uint64_t offset,
		    uint32_t len, const uint8_t *payload)
{
	uint8_t h[28];
	put_u32(h, REQUEST_MAGIC);
	put_u16(h + 4, 0);
	put_u16(h + 6, command);
	put_u64(h + 8, ++c->cookie);
	put_u64(h + 16, offset);
	put_u32(h + 24, len);
	if (payload) {
		/* Header and payload in one buffer, so the write is whole
		 * records rather than a lone 28-byte one. */
		uint8_t *buf = malloc(sizeof h + len);
		if (!buf)
			die("out of memory");
		memcpy(buf, h, sizeof h);
		memcpy(buf + sizeof h, payload, len);
		tls_write(c, buf, sizeof h + len);
		free(buf);
	} else {
		tls_write(c, h, sizeof h);
	}
}

static void simple_reply(struct client *c, const char *what, uint8_t *data,
			 uint32_t len)
{
	uint8_t h[16];
	tls_read(c, h, sizeof h);
	if (get_u32(h) != SIMPLE_REPLY_MAGIC)
		die("%s: bad reply magic %08x", what, get_u32(h));
	if (get_u32(h + 4) != 0)
		die("%s: NBD error %u", what, get_u32(h + 4));
	if (get_u64(h + 8) != c->cookie)
		die("%s: reply cookie %llu, expected %llu", what,
		    (unsigned long long)get_u64(h + 8),
		    (unsigned long long)c->cookie);
	if (data)
		tls_read(c, data, len);
}

static void nbd_write(struct client *c, uint64_t offset, const uint8_t *data,
		      uint32_t len)
{
	request(c, CMD_WRITE, offset, len, data);
	simple_reply(c, "write", NULL, 0);
	track_read_key(c);
}

static void nbd_read(struct client *c, uint64_t offset, uint8_t *data,
		     uint32_t len)
{
	request(c, CMD_READ, offset, len, NULL);
	simple_reply(c, "read", data, len);
	track_read_key(c);
}

/* Writes a fresh pattern over the region and reads it back. */
static void round_trip(struct client *c, uint64_t seed)
{
	static uint8_t want[REGION_LEN], got[REGION_LEN];
	fill_pattern(want, sizeof want, seed);
	nbd_write(c, REGION_OFFSET, want, sizeof want);
	memset(got, 0, sizeof got);
	nbd_read(c, REGION_OFFSET, got, sizeof got);
	compare(got, want, sizeof got, REGION_OFFSET);
}

/* One KeyUpdate; GnuTLS's error if it could not be sent. */
static int try_key_update(struct client *c, unsigned flags)
{
	double deadline = now_secs() + IO_TIMEOUT_SECS;
	int ret;
	while ((ret = gnutls_session_key_update(c->session, flags)) ==
		       GNUTLS_E_AGAIN ||
	       ret == GNUTLS_E_INTERRUPTED)
		if (now_secs() > deadline)
			die("gnutls_session_key_update timed out");
	return ret;
}

static void key_update(struct client *c, unsigned flags)
{
	uint8_t before[128], after[128];
	unsigned len_before = record_key(c, 0, before, sizeof before);
	int ret = try_key_update(c, flags);
	if (ret < 0)
		die("gnutls_session_key_update(%u): %s", flags,
		    gnutls_strerror(ret));
	unsigned len_after = record_key(c, 0, after, sizeof after);
	if (len_before == len_after && memcmp(before, after, len_after) == 0)
		die("gnutls_session_key_update(%u) left the write key as it was",
		    flags);
}

/* After something the server must end the session for: wait for that
 * end (close_notify, an alert or the connection closing), print how it
 * came, and tidy up. Exit status 0 only if it came with no data. */
static int expect_session_end(struct client *c,
			      gnutls_certificate_credentials_t cred, int fd,
			      const char *after)
{
	uint8_t byte;
	ssize_t r;
	double deadline = now_secs() + IO_TIMEOUT_SECS;
	while ((r = gnutls_record_recv(c->session, &byte, 1)) ==
		       GNUTLS_E_AGAIN ||
	       r == GNUTLS_E_INTERRUPTED)
		if (now_secs() > deadline)
			die("the server kept the session open after %s", after);
	if (r > 0)
		die("data from the server after %s", after);
	if (r == GNUTLS_E_FATAL_ALERT_RECEIVED)
		printf("server alert: %d\n", (int)gnutls_alert_get(c->session));
	printf("session ended by the server after %s: %s\n", after,
	       r == 0 ? "close_notify" : gnutls_strerror((int)r));
	gnutls_deinit(c->session);
	gnutls_certificate_free_credentials(cred);
	close(fd);
	gnutls_global_deinit();
	return 0;
}

static int connect_to(const char *host, const char *port)
{
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *res, *ai;
	int err = getaddrinfo(host, port, &hints, &res);
	if (err)
		die("%s:%s: %s", host, port, gai_strerror(err));
	int fd = -1;
	for (ai = res; ai; ai = ai->ai_next) {
		fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
		if (fd < 0)
			continue;
		if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
			break;
		close(fd);
		fd = -1;
	}
	freeaddrinfo(res);
	if (fd < 0)
		die("cannot connect to %s:%s: %s", host, port,
		    strerror(errno));
	struct timeval tv = { .tv_sec = IO_TIMEOUT_SECS };
	int one = 1;
	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
	    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) ||
	    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one))
		die("setsockopt: %s", strerror(errno));
	return fd;
}

static void check(int ret, const char *what)
{
	if (ret < 0)
		die("%s: %s", what, gnutls_strerror(ret));
}

int main(int argc, char **argv)
{
	if (argc < 8 || argc > 9) {
		fprintf(stderr,
			"usage: %s HOST PORT CAFILE CERTFILE KEYFILE EXPORT none|ku0|kupeer|alert|kuflood|long [REQUESTS]\n",
			argv[0]);
		return 2;
	}
	const char *host = argv[1], *port = argv[2], *cafile = argv[3];
	const char *certfile = argv[4], *keyfile = argv[5], *export = argv[6];
	const char *mode = argv[7];
	long requests = argc == 9 ? strtol(argv[8], NULL, 10) : 1000;
	int is_long = strcmp(mode, "long") == 0;
	int is_alert = strcmp(mode, "alert") == 0;
	int is_flood = strcmp(mode, "kuflood") == 0;
	if (!is_long && !is_alert && !is_flood && strcmp(mode, "none") &&
	    strcmp(mode, "ku0") && strcmp(mode, "kupeer")) {
		fprintf(stderr, "unknown mode %s\n", mode);
		return 2;
	}
	if (is_long && (requests < 1 || requests > 10000000)) {
		fprintf(stderr, "REQUESTS must be 1..10000000\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	check(gnutls_global_init(), "gnutls_global_init");

	phase = "negotiation";
	int fd = connect_to(host, port);
	uint8_t greeting[18];
	plain_read(fd, greeting, sizeof greeting);
	if (get_u64(greeting) != NBDMAGIC || get_u64(greeting + 8) != IHAVEOPT)
		die("not a fixed-newstyle NBD server");
	uint16_t server_flags = get_u16(greeting + 16);
	if ((server_flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)) !=
	    (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
		die("server handshake flags %#x lack FIXED_NEWSTYLE|NO_ZEROES",
		    server_flags);
	uint8_t client_flags[4];
	put_u32(client_flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
	plain_write(fd, client_flags, sizeof client_flags);
	starttls(fd);

	phase = "TLS handshake";
	gnutls_certificate_credentials_t cred;
	check(gnutls_certificate_allocate_credentials(&cred), "credentials");
	int n = gnutls_certificate_set_x509_trust_file(cred, cafile,
						       GNUTLS_X509_FMT_PEM);
	if (n <= 0)
		die("no CA certificate in %s: %s", cafile,
		    n < 0 ? gnutls_strerror(n) : "empty");
	check(gnutls_certificate_set_x509_key_file(cred, certfile, keyfile,
						   GNUTLS_X509_FMT_PEM),
	      "client certificate and key");
	struct client c = { 0 };
	hook_client = &c;
	check(gnutls_init(&c.session, GNUTLS_CLIENT), "gnutls_init");
	/* TLS 1.3 only: key updates, and the kernel hand-over, exist only
	 * there. */
	check(gnutls_priority_set_direct(c.session,
					 "NORMAL:-VERS-ALL:+VERS-TLS1.3",
					 NULL),
	      "priority");
	check(gnutls_credentials_set(c.session, GNUTLS_CRD_CERTIFICATE, cred),
	      "gnutls_credentials_set");
	check(gnutls_server_name_set(c.session, GNUTLS_NAME_DNS, SERVER_NAME,
				     strlen(SERVER_NAME)),
	      "server name");
	gnutls_session_set_verify_cert(c.session, SERVER_NAME, 0);
	gnutls_handshake_set_timeout(c.session, IO_TIMEOUT_SECS * 1000);
	gnutls_handshake_set_hook_function(c.session,
					   GNUTLS_HANDSHAKE_KEY_UPDATE,
					   GNUTLS_HOOK_PRE, key_update_hook);
	gnutls_transport_set_int(c.session, fd);
	int ret;
	double deadline = now_secs() + IO_TIMEOUT_SECS;
	do {
		ret = gnutls_handshake(c.session);
	} while (ret < 0 && !gnutls_error_is_fatal(ret) &&
		 now_secs() < deadline);
	if (ret < 0) {
		if (ret == GNUTLS_E_CERTIFICATE_VERIFICATION_ERROR) {
			gnutls_datum_t out;
			unsigned status = gnutls_session_get_verify_cert_status(
				c.session);
			gnutls_certificate_verification_status_print(
				status, GNUTLS_CRT_X509, &out, 0);
			die("server certificate: %s", out.data);
		}
		die("gnutls_handshake: %s", gnutls_strerror(ret));
	}
	if (gnutls_protocol_get_version(c.session) != GNUTLS_TLS1_3)
		die("negotiated %s, not TLS 1.3",
		    gnutls_protocol_get_name(
			    gnutls_protocol_get_version(c.session)));
	track_read_key(&c);

	phase = "NBD_OPT_GO";
	go(fd, &c, export);
	if (c.transmission_flags & TFLAG_READ_ONLY)
		die("export is read-only; the client writes");
	uint64_t end = REGION_OFFSET + REGION_LEN;
	if (c.export_size < end)
		die("export of %llu bytes is smaller than the %llu the client uses",
		    (unsigned long long)c.export_size,
		    (unsigned long long)end);

	if (is_flood) {
		/* More KeyUpdates without application data between them than
		 * a server should follow (rustls and BoringSSL stop at 32):
		 * the server must end the session. */
		phase = "before the flood";
		round_trip(&c, 1);
		phase = "key update flood";
		for (int i = 0; i < 40; i++) {
			int ret = try_key_update(&c, 0);
			/* Once the server has read past its limit it ends the
			 * session, and the updates still unread reset the
			 * connection: a later send may then fail. Only one of
			 * the first 33 failing is the server's fault. */
			if (ret == GNUTLS_E_PUSH_ERROR && i > 32)
				break;
			if (ret < 0)
				die("key update %d of the flood: %s", i + 1,
				    gnutls_strerror(ret));
		}
		return expect_session_end(&c, cred, fd, "the flood");
	}

	if (is_alert) {
		/* A warning alert that TLS 1.3 treats as an error whatever
		 * its level (RFC 8446 §6): the server must end the session. */
		phase = "before the alert";
		round_trip(&c, 1);
		phase = "alert";
		check(gnutls_alert_send(c.session, GNUTLS_AL_WARNING,
					GNUTLS_A_UNRECOGNIZED_NAME),
		      "gnutls_alert_send");
		return expect_session_end(&c, cred, fd, "the alert");
	}

	if (is_long) {
		phase = "long session";
		static uint8_t want[REGION_LEN], got[LONG_READ_LEN];
		fill_pattern(want, sizeof want, 7);
		nbd_write(&c, REGION_OFFSET, want, sizeof want);
		unsigned slots = REGION_LEN / LONG_READ_LEN;
		unsigned rekeys = c.server_key_updates;
		for (long i = 0; i < requests; i++) {
			uint64_t at = (uint64_t)(i % slots) * LONG_READ_LEN;
			nbd_read(&c, REGION_OFFSET + at, got, sizeof got);
			compare(got, want + at, sizeof got, REGION_OFFSET + at);
			/* GnuTLS refuses a ninth KeyUpdate received within
			 * 1000 ms (lib/tls13/key_update.c, KEY_UPDATES_WINDOW,
			 * KEY_UPDATES_PER_WINDOW; 3.6.16 to 3.8): after each
			 * of the server's, a pause keeps a fast test from
			 * tripping that limit. */
			if (c.server_key_updates != rekeys) {
				rekeys = c.server_key_updates;
				struct timespec pause = { 0, 150 * 1000000L };
				nanosleep(&pause, NULL);
			}
		}
		printf("requests: %ld\n", requests);
	} else {
		phase = "before the key update";
		round_trip(&c, 1);
		round_trip(&c, 2);
		if (strcmp(mode, "none") != 0) {
			phase = "key update";
			unsigned flags = strcmp(mode, "kupeer") == 0 ?
						 GNUTLS_KU_PEER :
						 0;
			key_update(&c, flags);
			printf("key update sent (flags %u)\n", flags);
		}
		phase = "after the key update";
		unsigned seen_at = 0;
		for (unsigned i = 0; i < 4; i++) {
			round_trip(&c, 3 + i);
			if (!seen_at && c.server_key_updates)
				seen_at = i + 1;
		}
		if (strcmp(mode, "kupeer") == 0) {
			if (c.server_key_updates == 0)
				die("asked the server to update its keys (GNUTLS_KU_PEER); no KeyUpdate came back in 4 round trips");
			printf("server KeyUpdate seen after %u round trip(s)\n",
			       seen_at);
		}
	}

	phase = "disconnect";
	request(&c, CMD_DISC, 0, 0, NULL);
	/* The server answers NBD_CMD_DISC by ending the TLS session. */
	uint8_t extra;
	ssize_t got;
	deadline = now_secs() + IO_TIMEOUT_SECS;
	while ((got = gnutls_record_recv(c.session, &extra, 1)) ==
		       GNUTLS_E_AGAIN ||
	       got == GNUTLS_E_INTERRUPTED)
		if (now_secs() > deadline)
			die("timed out waiting for the server's close_notify");
	if (got > 0)
		die("data after NBD_CMD_DISC");
	if (got < 0)
		die("no clean close_notify after NBD_CMD_DISC: %s",
		    gnutls_strerror((int)got));
	ret = gnutls_bye(c.session, GNUTLS_SHUT_WR);
	if (ret < 0)
		die("gnutls_bye: %s", gnutls_strerror(ret));

	/* Each KeyUpdate the hook counted must show as a new read key (two
	 * between one reply and the next would show as one change). */
	if (c.read_key_changes > c.server_key_updates ||
	    (c.server_key_updates > 0 && c.read_key_changes == 0))
		die("%u KeyUpdate messages from the server, but the read key changed %u times",
		    c.server_key_updates, c.read_key_changes);
	if (c.server_update_requests)
		fprintf(stderr, "note: %u server KeyUpdate(s) asked for ours\n",
			c.server_update_requests);
	printf("read key changes: %u\n", c.read_key_changes);
	printf("server rekeys: %u\n", c.server_key_updates);
	gnutls_deinit(c.session);
	gnutls_certificate_free_credentials(cred);
	close(fd);
	gnutls_global_deinit();
	return 0;
}
