"""The fd channel's wire format: a worker's descriptors handed over for tickets, and watches.

One connection carries one exchange on an AF_UNIX SOCK_SEQPACKET socket (the server's
HELLO names it as `fd_socket`):

- request: one message whose data is BOUND_FD_CHANNEL_MAGIC followed by the
  BINDING_BYTES of the sender's session binding (HELLO's fd_binding), and whose ancillary
  data carries 1..MAX_FDS_PER_MESSAGE descriptors, each a shmem memfd sealed with
  F_SEAL_SHRINK. (Version 1, FD_CHANNEL_MAGIC alone, names no session.)
- reply: one message, a msgpack map: {"tickets": [TICKET_BYTES bytes, ...]}, one per
  descriptor in order, or {"error": "<which descriptor and why>"}, in which case none was
  kept.

A ticket stands for its descriptor in one REGISTER_KV_CACHE (MemfdHandle.ticket) sent by
a session of the same uid as the sender and, for a version 2 request, of the binding's
engine; it lapses after TICKET_TTL_S seconds unused.

Or, a watch: the request's data is WATCH_MAGIC, with no descriptor; the reply is
{"watch": TICKET_BYTES bytes} (or {"error": ...}), and the connection stays open. A
REGISTER_KV_CACHE that names the watch is dropped, and its memory unmapped, as soon as the
connection hangs up: when the worker exits or dies, the kernel closes it, long before
heartbeats would lapse.

The client side is lmcache_mp/fdpass.py; the server side, the server's fd_channel module.
"""

FD_CHANNEL_MAGIC = b"lmcache-mp-fds/1"
BOUND_FD_CHANNEL_MAGIC = b"lmcache-mp-fds/2"  # then the session's fd_binding
WATCH_MAGIC = b"lmcache-mp-watch/1"
REPLY_BYTES = 4096  # the largest reply: MAX_FDS_PER_MESSAGE tickets, or one error line
TICKET_BYTES = 16  # a ticket (or a watch), as a memfd handle or REGISTER_KV_CACHE names it
BINDING_BYTES = 16  # HELLO's fd_binding: what binds the fd channel's tickets to the session
