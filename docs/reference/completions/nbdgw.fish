# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_nbdgw_global_optspecs
    string join \n listen= tls-cert= tls-key= tls-dir= tls-client-ca= tls-crl= verified-chain-cache= tls-crl-allow-expired tls-revoke-closes= tls-cipher-order= tls-min-version= tls-groups= tls-reload-interval= ktls= ktls-key-limit= allow-cn= allow-dns= allow-uri= policy= policy-revoke-closes= upstream= export= export-dir= export-dir-owner= upstream-sndbuf= immutable-export= immutable cache-size= cache-block-size= read-ahead= read-ahead-depth= cache-fill-depth= max-connections= max-sessions-per-identity= max-handshakes= max-handshakes-per-source= handshake-queue= handshake-queue-per-source= handshake-queue-timeout= handshake-reserve= source-memory= source-prefix-v4= source-prefix-v6= proxy-protocol-from= proxy-protocol-serve-local= proxy-protocol-timeout= proxy-protocol-max-header= handshake-timeout= upstream-timeout= idle-timeout= stall-timeout= tcp-keepalive= max-payload= max-option-len= tcp-keepalive-interval= tcp-keepalive-count= max-refused-options= cork= admin-listen= admin-max-connections= admin-header-timeout= admin-keepalive-requests= admin-keepalive-timeout= admin-max-header-bytes= drain-delay= shutdown-grace= drain-answer= handover-socket= take-over= handover-timeout= handover-queue-timeout= handover-quiesce-timeout= handover-max-key-generations= handover-fdstore landlock= threads= log-format= h/help V/version
end

function __fish_nbdgw_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_nbdgw_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_nbdgw_using_subcommand
    set -l cmd (__fish_nbdgw_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c nbdgw -n "__fish_nbdgw_needs_command" -l listen -d 'Address to listen on (the IANA NBD port by default)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-cert -d 'Server certificate chain (PEM)' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-key -d 'Server private key (PEM)' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-dir -d 'Directory holding the certificate, key and optionally the client CA and CRL: the qemu/nbdkit layout (server-cert.pem, server-key.pem, ca-cert.pem, ca-crl.pem) or a Kubernetes TLS Secret (tls.crt, tls.key, ca.crt). A CA there makes client certificates required. Files named by the other --tls-* flags take precedence' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-client-ca -d 'CA bundle (PEM) that client certificates must chain to. Without it (or a CA in --tls-dir) client certificates are not requested' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-crl -d 'CRLs (PEM) from the client CA: revoked client certificates are refused' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l verified-chain-cache -d 'Accepted client certificate chains remembered, so that a client reconnecting is not put through its chain\'s path building and signature checks again (its handshake signature is always checked). Each is kept until its earliest notAfter or the CRLs\' nextUpdate, and every TLS reload starts afresh; 0 keeps none' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-revoke-closes -d 'End established sessions whose client certificate a reloaded CRL revokes (true or false)' -r -f -a "true\t''
false\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-cipher-order -d 'Whose order picks the cipher suite among those both sides have' -r -f -a "server\t'nbdgw\'s: AES-128-GCM, then AES-256-GCM, then ChaCha20-Poly1305 (as Go\'s and BoringSSL\'s servers choose). GnuTLS clients (qemu, libnbd) list AES-256-GCM first; AES-128-GCM is a TLS 1.3 suite every client must have, costs a SHA-256 key schedule (with the CPU\'s SHA instructions) instead of SHA-384, and encrypts faster'
client\t'The client\'s order, as rustls does by default'"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-min-version -d 'Oldest TLS version accepted' -r -f -a "1.2\t'The NBD spec requires servers to support TLS 1.2'
1.3\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-groups -d 'Key exchange groups accepted, comma-separated, as rustls and OpenSSL name them: X25519MLKEM768 (hybrid post-quantum), secp256r1MLKEM768, X25519, secp256r1 (P-256), secp384r1 (P-384), MLKEM768, MLKEM1024. The client\'s order picks among them (rustls); GnuTLS clients offer no hybrid and get a classical group' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-reload-interval -d 'Seconds between looks at the TLS files for changes; 0 reloads only on SIGHUP' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l ktls -d 'Kernel TLS: after the handshake, hand TLS 1.3 sessions to the kernel\'s record layer when it has one (auto: probed at start, rustls otherwise), or never (off)' -r -f -a "auto\t'When the kernel offers it (probed at start), rustls otherwise'
off\t'Never: rustls keeps every session'"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l ktls-key-limit -d 'For tests: records nbdgw sends under one key on a kernel TLS session before it updates its own keys (default: the cipher\'s confidentiality limit, halved)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l allow-cn -d 'Admit client certificates with this subject CN (repeatable). Exact match. The flag takes its value whole, commas included; only the variable is a comma-separated list' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l allow-dns -d 'Admit client certificates with this DNS SAN; a `*` label matches one label (repeatable; comma-separated in the variable)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l allow-uri -d 'Admit client certificates with this URI SAN, e.g. a SPIFFE ID; a `*` segment matches one path segment (repeatable; comma-separated in the variable)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l policy -d 'TOML file saying which client identities may open which exports, read-write or read-only; reloaded like the TLS files, and a reload may only narrow it. Without it every admitted client may open every export read-write. Needs client certificates (a client CA)' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l policy-revoke-closes -d 'End established sessions whose access a policy reload withdraws or reduces to read-only, for their identity and export (true or false); false leaves them their access until they end' -r -f -a "true\t''
false\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l upstream -d 'Unix socket of the NBD server to relay to; every export name the client asks for goes to it unchanged' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l export -d 'A named export instead of --upstream: clients asking for NAME are relayed to the server on the Unix socket PATH, which is asked for UPSTREAM_NAME (default ""). Repeatable, or comma-separated' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l export-dir -d 'Every Unix socket NAME.sock in this directory is the export NAME, and TENANT/NAME.sock in a subdirectory the export TENANT/NAME; picked up and dropped as sockets appear and disappear' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l export-dir-owner -d 'Whose sockets --export-dir serves: same (the default: a socket owned by its directory\'s owner, whose server, by SO_PEERCRED, runs as that uid); a numeric uid (directory, socket and server all that uid); or any (whoever can create a socket there). Symbolic links are never followed, whatever this says' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l upstream-sndbuf -d 'SO_SNDBUF for upstream sockets in bytes; 0 keeps the kernel default' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l immutable-export -d 'Declares the export NAME immutable: its data never changes while nbdgw runs (a golden image). It is read-only for every identity, and its reads go through the shared read cache (--cache-size). A `*` component matches any one component (`golden/*`). Repeatable, or comma-separated. Never the default' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l cache-size -d 'Bytes of memory the read cache of immutable exports may hold, in blocks (--cache-block-size) shared by every connection; 0 turns it off (the exports stay read-only)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l cache-block-size -d 'Bytes per read cache block (a power of two, 4096 to 65536): a read that misses fetches the whole blocks around it. Larger blocks bring a boot\'s neighbouring reads in with one upstream read; smaller ones fetch less for scattered reads of a working set larger than the cache' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l read-ahead -d 'Bytes one read-ahead request fetches into the cache once a connection reads an immutable export sequentially (rounded down to whole blocks, at most --max-payload); 0 turns read-ahead off' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l read-ahead-depth -d 'Read-ahead requests one connection may have in flight at once' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l cache-fill-depth -d 'Reads that missed the cache one connection may have in flight at once as fills (widened to whole blocks, answered from a buffer when the reply is complete); past this, a read goes upstream as it came, and is cached as its reply passes if it is short' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-connections -d 'Most client connections served at once; more are closed at accept' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-sessions-per-identity -d 'Of those, how many one client identity (the certificate\'s CN, DNS and URI names; clients without certificates are one identity) may hold; more are told so and closed. Default: a quarter of --max-connections with client certificates, all of it without' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-handshakes -d 'Connections still negotiating (before their client certificate is verified) served at once, apart from --max-connections; more wait their turn (see --handshake-queue)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-handshakes-per-source -d 'Of those, how many one source (see --source-prefix-v4 and --source-prefix-v6) may hold' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handshake-queue -d 'Connections that may wait for a handshake slot, all sources together (one descriptor each, no buffers); when full, the longest waiter of the source with the most waiting makes room' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handshake-queue-per-source -d 'Of those, how many one source may have waiting; more from it are closed at accept' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handshake-queue-timeout -d 'Seconds a connection may wait for its handshake slot before it is closed, counted from accept; never more than --handshake-timeout, which the wait uses up' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handshake-reserve -d 'Of --max-handshakes, the slots only proven sources (see --source-memory) may take, so slow handshakes from unproven sources, however many, never hold them all. Default: a quarter' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l source-memory -d 'Seconds a source stays "proven" after one of its clients opened an export with a client certificate: it may use --handshake-reserve, and its waiting connections are never shed for those of unproven sources; 0 (or no client CA): no source is' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l source-prefix-v4 -d 'Leading bits of an IPv4 address (0 to 32) that make one source for --max-handshakes-per-source; IPv4-mapped IPv6 peers count as IPv4' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l source-prefix-v6 -d 'Leading bits of an IPv6 address (0 to 128) that make one source for --max-handshakes-per-source: a host usually owns a whole /64' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l proxy-protocol-from -d 'Trust this balancer (an address, or a CIDR prefix; repeatable; comma-separated in the variable) to put a PROXY protocol header (v1 or v2) before each connection: its connections must start with one, and the address it carries is the client\'s for admission, logs and the audit trail. From anyone else no header is read. Items are trimmed; empty ones are skipped' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l proxy-protocol-serve-local -d 'Serve connections whose PROXY v2 header is LOCAL as the balancer\'s own (true or false). HAProxy sends LOCAL for its health checks but also for clients it cannot name (a unix socket frontend), which would all count as one source; by default such a connection is closed right after its header (a balancer\'s check has passed by then)' -r -f -a "true\t''
false\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l proxy-protocol-timeout -d 'Seconds a connection from a --proxy-protocol-from balancer has from accept to the end of its PROXY header (balancers send it at once); --handshake-timeout still bounds it if shorter' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l proxy-protocol-max-header -d 'The longest PROXY protocol v2 header taken, in bytes (16, the addresses, and TLVs, which are skipped); a longer one is refused' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handshake-timeout -d 'Seconds a client has from its accept to its session: the wait for a handshake slot, the TLS handshake and negotiation together; one whose slot came late in line still has half of it from then (the whole time is at most 1.5 times it)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l upstream-timeout -d 'Seconds an upstream may take, in negotiation, to accept and greet, and then to answer each option; a server that does not gets the client NBD_REP_ERR_SHUTDOWN. Keep it below --handshake-timeout' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l idle-timeout -d 'Seconds a connection may sit with no request in flight and no reply being written, counted from the last reply\'s last byte; 0 never closes it (VM disks can be idle for hours)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l stall-timeout -d 'Seconds a started request payload, or a reply the client does not read, may make no progress before the connection is closed; also the TCP_USER_TIMEOUT for unacknowledged data. 0: never' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tcp-keepalive -d 'Seconds of silence before TCP keepalive probes a client; 0 turns keepalive off. A client that powered off is closed after about IDLE + INTERVAL x COUNT seconds' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-payload -d 'Largest request payload and read length in bytes' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-option-len -d 'Largest option data (and option reply) in bytes' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tcp-keepalive-interval -d 'Seconds between keepalive probes' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tcp-keepalive-count -d 'Unanswered keepalive probes before the connection is dropped' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l max-refused-options -d 'Export names one connection may have refused (malformed, not granted by the policy, or unknown) before it is closed: each refusal logs a line' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l cork -d 'TCP_CORK around replies: deferred (held while the next reply is already waiting), per-reply (as QEMU), or off. For measuring; the default gives full segments' -r -f -a "deferred\t'Corked while the next reply is already waiting; released when nothing more is (a burst that fits one write needs no cork at all)'
per-reply\t'Corked around every reply and released after it, as QEMU does'
off\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-listen -d 'Plain-HTTP admin endpoints (/healthz, /readyz, /metrics) on this address, meant for localhost or the pod network; off by default' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-max-connections -d 'Admin connections open at once; more are closed at accept (and counted), so probes and scrapers can never take the descriptors the NBD clients need' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-header-timeout -d 'Seconds an admin connection has to send a request\'s headers, from accept or from the previous response; slower ones are closed' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-keepalive-requests -d 'Requests one admin connection may send (keep-alive); the response to the last says Connection: close. 1: no keep-alive' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-keepalive-timeout -d 'Seconds an admin connection may stay open in all, however busy; then it is closed after the response in progress' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l admin-max-header-bytes -d 'Largest admin request head (request line and headers) in bytes; larger ones are refused. At least 8192 (hyper\'s smallest buffer)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l drain-delay -d 'Seconds to go on accepting after SIGTERM, not ready, so that load balancers stop sending clients first (5 s suits Kubernetes)' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l shutdown-grace -d 'Seconds open connections may finish after SIGTERM or SIGINT' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l drain-answer -d 'While draining, a request that arrives after the drain began: close (unanswered; the connection closes once every earlier request is answered, so qemu\'s reconnect-delay sends it again) or eshutdown (answered ESHUTDOWN, which qemu hands to the guest)' -r -f -a "close\t'Leave it unanswered and close the connection once every request forwarded before the drain is answered: a clean close at a request boundary. qemu with `reconnect-delay` reconnects and sends it again; an ESHUTDOWN answer it would hand to the guest'
eshutdown\t'Answer it ESHUTDOWN at once, and close once nothing is in flight'"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-socket -d 'Listen on this Unix socket for a successor (`--take-over PATH`): it is given the listening sockets, this process stops accepting, drains its sessions as on SIGTERM and exits 0. Created 0600; a directory others may write is refused unless it is sticky; only a stale socket of this uid is replaced. Off by default' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l take-over -d 'Start as the successor of the gateway listening on this hand-over socket (same uid): take its listening sockets (those whose address matches --listen / --admin-listen / --handover-socket; others are bound here) and serve them. Fails the start if the predecessor refuses, and under systemd (NOTIFY_SOCKET set: a successor in the unit dies with it; use --handover-fdstore and systemctl restart)' -r -F
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-timeout -d 'Seconds a hand-over may take, on either side, from the moment the predecessor serves the successor to its first accept (a successor queued behind another waits apart, --handover-queue-timeout). A successor that stalls or dies before it is told to serve leaves the predecessor serving; once told, it keeps the sockets unless it gives up or its process is gone. While a successor holds the listeners nobody accepts (connections wait in the backlog), so this is also the longest such pause' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-queue-timeout -d 'Seconds a successor waits to be served by the running gateway, which serves one successor at a time, each for up to its own --handover-timeout: a successor queued behind others (or behind a connection that says nothing) fails its start past this, saying so. The running gateway serves on meanwhile' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-quiesce-timeout -d 'Seconds a session being handed to a successor may take to go quiet: it stops reading requests at a request boundary and the replies to those already upstream finish. One that is not quiet in time stays here and drains as on SIGTERM. It is also the longest pause a client can see in its requests' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-max-key-generations -d 'Key generations a TLS 1.3 session may be at when it is handed to a successor: its traffic secrets are followed from the handshake\'s through each KeyUpdate (two HKDF-Expands each, off the async workers and one session at a time). rustls re-keys every 2^24 records, so the default is ~64 TiB of traffic for an honest peer; a session past it is closed at the hand-over (its keys have left rustls by then), with a log line' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l landlock -d 'Restrict the process with Landlock once started: read access only beneath the TLS (and policy) files\' directories, no other file, Unix connects only to the upstream sockets, no TCP bind or connect, no abstract Unix socket or signal outside the process. true: what the kernel has (a kernel with less logs what stays open and serves); required: refuse to start unless all of it is enforced (Landlock ABI 9, Linux 7.1); false: no sandbox' -r -f -a "true\t'Sandbox with what the kernel has; a kernel with less logs what is left open and serves'
false\t'No sandbox'
required\t'Refuse to start unless every restriction is enforced'"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l threads -d 'Worker threads; 0 means one per CPU. In a container, match the CPU limit' -r
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l log-format -d 'Log format; the filter comes from RUST_LOG (default info)' -r -f -a "text\t''
json\t''"
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l tls-crl-allow-expired -d 'Admit clients whose CRL is past its nextUpdate. Without it such a client is refused until a fresh CRL is in place'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l immutable -d 'With --upstream: every export it serves is immutable (see --immutable-export)'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -l handover-fdstore -d 'Under systemd (`systemctl restart`): at SIGTERM, instead of draining them, quiesce the sessions and leave each one in systemd\'s file-descriptor store (its client socket, its upstream socket and a memfd with its state), for the next instance of the unit to serve on. Needs FileDescriptorStoreMax= and NOTIFY_SOCKET (the start fails without it). Sessions that cannot be stored drain as today; a stop that is not a restart closes the stored ones. Off by default; the shipped unit sets it'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -s V -l version -d 'Print version'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -f -a "certs" -d 'Make a CA, a server certificate and client certificates in the layout qemu, nbdkit and libnbd read'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -f -a "policy" -d 'Validate a --policy file, or show what it grants one certificate, before a rollout'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -f -a "client" -d 'Client mode: serve plaintext NBD on a Unix socket or loopback port to local clients (the kernel\'s nbd-client, clients without TLS), and relay each to a remote NBD server over STARTTLS and verified TLS'
complete -c nbdgw -n "__fish_nbdgw_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l out -d 'Directory to write into (created if missing)' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l server-name -d 'DNS name or IP address for the server certificate (repeatable; default localhost and 127.0.0.1)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l client-name -d 'Common name of a client certificate (repeatable; default nbdgw-client). The first is client-cert.pem, others client-NAME-cert.pem' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l client-uri -d 'URI SAN for a client certificate, e.g. a SPIFFE ID (repeatable: the Nth goes into the Nth client certificate)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l days -d 'Validity of the leaf certificates in days' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l ca-cert -d 'Issue from this existing CA certificate instead of making a new CA (with --ca-key), e.g. one kept with --keep-ca-key' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l ca-key -d 'The key of --ca-cert' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l force -d 'Overwrite existing files'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -l keep-ca-key -d 'Keep the new CA\'s key as ca-key.pem (mode 0600), to issue more certificates from it later; without it the key is thrown away'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand certs" -s h -l help -d 'Print help'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and not __fish_seen_subcommand_from check explain help" -s h -l help -d 'Print help'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and not __fish_seen_subcommand_from check explain help" -f -a "check" -d 'Parse the policy file as nbdgw would at start. Exit status 0 when it is valid; otherwise 1, with FILE:LINE:COLUMN and the problem on stderr'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and not __fish_seen_subcommand_from check explain help" -f -a "explain" -d 'Show which rule decides whether the client certificate may open the export, and with what access. Exit status 0 when a rule grants it, 1 when none does, 2 on an error. The --allow-* flags, which nbdgw checks first, are not consulted'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and not __fish_seen_subcommand_from check explain help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from check" -s h -l help -d 'Print help'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from explain" -l policy -d 'The policy file (TOML)' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from explain" -l cert -d 'The client certificate (PEM; the first certificate in the file)' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from explain" -l export -d 'The export name as the client would ask for it' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from explain" -s h -l help -d 'Print help'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from help" -f -a "check" -d 'Parse the policy file as nbdgw would at start. Exit status 0 when it is valid; otherwise 1, with FILE:LINE:COLUMN and the problem on stderr'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from help" -f -a "explain" -d 'Show which rule decides whether the client certificate may open the export, and with what access. Exit status 0 when a rule grants it, 1 when none does, 2 on an error. The --allow-* flags, which nbdgw checks first, are not consulted'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand policy; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l listen -d 'Where local clients connect: a Unix socket path, or a loopback HOST:PORT (the local side is plaintext, so no other address is accepted)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l server -d 'The remote NBD server (TLS with STARTTLS), e.g. nbd.example:10809 or [2001:db8::1]:10809' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l server-name -d 'The name the server\'s certificate must carry (a DNS or IP SAN); default: the host of --server' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l server-timeout -d 'Seconds the server may take to accept, greet and finish TLS, and then to answer each option; a local client then hears why. Keep it below --handshake-timeout' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-dir -d 'Directory with the CA and the client certificate: the layout of libnbd and qemu (ca-cert.pem, client-cert.pem, client-key.pem, optionally ca-crl.pem) or a Kubernetes TLS Secret (ca.crt, tls.crt, tls.key). Files named by the other --tls-* flags take precedence' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-ca -d 'CA bundle (PEM) the server\'s certificate must chain to' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-cert -d 'Client certificate chain (PEM) to present' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-key -d 'The client certificate\'s private key (PEM)' -r -F
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-min-version -d 'Oldest TLS version offered to the server' -r -f -a "1.2\t'The NBD spec requires servers to support TLS 1.2'
1.3\t''"
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-groups -d 'Key exchange groups offered to the server, most preferred first, comma-separated, as rustls and OpenSSL name them: X25519MLKEM768 (hybrid post-quantum), secp256r1MLKEM768, X25519, secp256r1 (P-256), secp384r1 (P-384), MLKEM768, MLKEM1024. The first gets a key share in the ClientHello (with the default order, a hybrid\'s X25519 half too); a server with neither costs a HelloRetryRequest. Pure ML-KEM groups are an expert\'s choice (a warning at start)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tls-reload-interval -d 'Seconds between looks at the TLS files for changes (a new CA bundle or client certificate is used by new connections); 0 reloads only on SIGHUP' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l reconnect-timeout -d 'Seconds from a drop --reconnect waits for a server connection that answers before the requests in flight fail with EIO; new ones then fail at once until the server answers again (tries go on)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l replay-buffer -d 'Bytes of requests in flight (write payloads included) --reconnect keeps per connection until they are answered; beyond it new requests wait. One request is always let through' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l reply-buffer -d 'Bytes of structured replies --reconnect holds per connection until their last chunk has come, so that a reply cut by a drop is asked again whole instead of ending in EIO. A reply beyond it goes up as it comes (and, if cut, ends in EIO)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l handshake-timeout -d 'Seconds a local client has from connecting to finishing negotiation' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l idle-timeout -d 'Seconds a connection may sit with no request in flight; 0 never closes it' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l stall-timeout -d 'Seconds a started request payload or an unread reply may make no progress before the connection is closed; also the server connection\'s TCP_USER_TIMEOUT. 0: never' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l tcp-keepalive -d 'Seconds of silence before TCP keepalive probes the server; 0 turns keepalive off' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l max-payload -d 'Largest request payload and read length in bytes' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l max-option-len -d 'Largest option data (and option reply) in bytes' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l max-connections -d 'Most local connections served at once; more are closed at accept' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l admin-listen -d 'Plain-HTTP admin endpoints (/healthz, /readyz, /server, /metrics) on this address, as the server mode\'s; off by default. /readyz fails while the last try to reach the server failed; /server fails while a --reconnect connection is reconnecting (/readyz stays ready)' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l shutdown-grace -d 'Seconds open connections may finish after SIGTERM or SIGINT' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l drain-answer -d 'While draining, a local request that arrives after the drain began: close (unanswered; the connection closes once every earlier request is answered) or eshutdown (answered ESHUTDOWN)' -r -f -a "close\t'Leave it unanswered and close the connection once every request forwarded before the drain is answered: a clean close at a request boundary. qemu with `reconnect-delay` reconnects and sends it again; an ESHUTDOWN answer it would hand to the guest'
eshutdown\t'Answer it ESHUTDOWN at once, and close once nothing is in flight'"
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l threads -d 'Worker threads; 0 means one per CPU' -r
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l log-format -d 'Log format; the filter comes from RUST_LOG (default info)' -r -f -a "text\t''
json\t''"
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -l reconnect -d 'Keep local connections when the server\'s connection drops: reconnect, open the same export (its size and flags checked unchanged) and send the requests in flight again, in order'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand client" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and not __fish_seen_subcommand_from certs policy client help" -f -a "certs" -d 'Make a CA, a server certificate and client certificates in the layout qemu, nbdkit and libnbd read'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and not __fish_seen_subcommand_from certs policy client help" -f -a "policy" -d 'Validate a --policy file, or show what it grants one certificate, before a rollout'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and not __fish_seen_subcommand_from certs policy client help" -f -a "client" -d 'Client mode: serve plaintext NBD on a Unix socket or loopback port to local clients (the kernel\'s nbd-client, clients without TLS), and relay each to a remote NBD server over STARTTLS and verified TLS'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and not __fish_seen_subcommand_from certs policy client help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and __fish_seen_subcommand_from policy" -f -a "check" -d 'Parse the policy file as nbdgw would at start. Exit status 0 when it is valid; otherwise 1, with FILE:LINE:COLUMN and the problem on stderr'
complete -c nbdgw -n "__fish_nbdgw_using_subcommand help; and __fish_seen_subcommand_from policy" -f -a "explain" -d 'Show which rule decides whether the client certificate may open the export, and with what access. Exit status 0 when a rule grants it, 1 when none does, 2 on an error. The --allow-* flags, which nbdgw checks first, are not consulted'
