"""Who may commit, and how: the two-phase commit of parts and the manifest, the sharded commit and
its process group, the writer lease, generation fencing, and the history of committed steps."""
