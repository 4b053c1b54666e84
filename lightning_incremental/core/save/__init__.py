"""The save path: the snapshot, the background save queue, the saver that writes parts and
commits them, the saves in flight, and what must finish at interpreter exit."""
