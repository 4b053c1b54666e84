"""The load path: choosing the checkpoint to restore (with fallback), planning what to decode and
into what, reading and scattering chunks, and turning bytes into tensors."""
