"""The requests: the dispatcher that admits and routes each one, and a module per op."""
