"""One chunk's life: its delta base, its encoding into a pack, and its decoding and verification
on the way back."""
