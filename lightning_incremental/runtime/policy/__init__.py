"""What the adapters decide, framework-free: when a save is due by its cost (:mod:`.cadence`),
what a failed save does (:mod:`.failures`), how many saves may be in flight
(:mod:`.backpressure`), what diverged replicas do (:mod:`.replica_policy`), and what a
preemption notice does (:mod:`.preemption`, over :mod:`.preemption_os` and cloud notices
:mod:`.preemption_notice`)."""
