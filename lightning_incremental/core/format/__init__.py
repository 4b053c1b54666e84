"""What is on disk: the store's layout, the manifest's records and their canonical JSON, the
validator, the checkpoint's skeleton (tree) and the pieces of sharded tensors.

Pure data and functions of it: nothing here reads or writes a storage.
"""
