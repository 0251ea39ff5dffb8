"""The test suite.

Every TCPStore connection makes torch look up the peer's name: a PTR query for
127.0.0.1, which /etc/hosts does not answer for its IPv4-mapped IPv6 form. A DNS
server that drops the query stalls the connection for the resolver's timeout, 5 s
by default. The variable below caps that at 1 s, in this process and in the Ray
workers it starts; glibc reads it once, before the first lookup, which is why it
is set here, before conftest imports anything.
"""

import os

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
