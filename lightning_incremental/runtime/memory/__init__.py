"""The memory tier: a rank's part of a step in node-local memory (:mod:`.tier`, its mapped
files :mod:`.slots`, reading it back :mod:`.read`), replicas on other nodes and the agreement
on what is recoverable (:mod:`.replica`), the step a restart resumes from (:mod:`.agree`),
sharded parts (:mod:`.shards`), and one run's tier as the adapters use it (:mod:`.steps`)."""
