"""The transports: the ZeroMQ socket and replies, the fd channel, sessions, the HTTP endpoint."""
