"""A rank's part of the training state that no framework saves for it: its random state
(:mod:`.rng`), its own buffers (:mod:`.rank_buffers`), its position in the data
(:mod:`.data_position`, and the epoch's order over another world size :mod:`.data_order`), and
replica fingerprints, comparison and repair (:mod:`.replicas`)."""
