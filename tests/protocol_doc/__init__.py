"""docs/protocol.md, checked against the code and a real server: each module takes one part of
the document (its tables, example exchanges, sessions, fd channel, quotas, MLA and push
messages, the example client)."""
