"""Copies off the event loop: the CPU copy engine and the GPU stream copier."""
