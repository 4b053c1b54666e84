"""The job's processes as one: the process group (:mod:`.collectives`), the coordinator acting
for every rank (:mod:`.coordinate`), store calls bounded by a deadline (:mod:`.bounded`), the
heartbeat watchdog and its judgement (:mod:`.watchdog`, :mod:`.judgement`), and a run's start
as the writer of its store (:mod:`.writing`)."""
