"""An HTTP POST whose body arrives in pieces (Transfer-Encoding: chunked, no Content-Length), as a slow or streaming
client sends it: a server must read it to its end, not only what is buffered when the handler starts."""

from __future__ import annotations

import http.client
import time

PIECE = 16 * 1024


def chunked_post(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """(status, body) of POSTing `body` in 16 KiB pieces with a short pause between them."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.putrequest("POST", path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for i in range(0, len(body), PIECE):
            piece = body[i : i + PIECE]
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.002)
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
