"""What one libnbd client sees through nbdgw, as JSON on stdout, for
tests/routing.rs: the export list, or one export's read-only flag, a
write's outcome (errno name) and a read after it.

    libnbd_probe.py list PORT CERT_DIR
    libnbd_probe.py open PORT CERT_DIR EXPORT
"""

import errno
import json
import sys

import nbd


def handle(port, cert_dir):
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(cert_dir)
    return h


def listing(port, cert_dir):
    h = handle(port, cert_dir)
    h.set_opt_mode(True)
    h.connect_tcp("localhost", port)
    names = []
    h.opt_list(lambda name, description: names.append(name) or 0)
    h.opt_abort()
    return {"exports": names}


def opening(port, cert_dir, export):
    h = handle(port, cert_dir)
    h.set_export_name(export)
    try:
        h.connect_tcp("localhost", port)
    except nbd.Error as e:
        return {"opened": False, "error": e.string}
    result = {"opened": True, "read_only": bool(h.is_read_only()), "size": h.get_size()}
    try:
        h.pwrite(b"W" * 512, 0)
        result["write"] = "ok"
    except nbd.Error as e:
        result["write"] = errno.errorcode.get(e.errno, str(e.errno))
    result["read"] = h.pread(512, 0).decode("latin-1")[:8]
    h.shutdown()
    return result


if __name__ == "__main__":
    command, port, cert_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    if command == "list":
        print(json.dumps(listing(port, cert_dir)))
    else:
        print(json.dumps(opening(port, cert_dir, sys.argv[4])))
