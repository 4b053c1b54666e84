"""Work on checkpoints already committed: retention, compaction, verification, the sweep of
unreferenced objects, and export to plain files."""
