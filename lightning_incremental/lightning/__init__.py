"""The Lightning adapter: :class:`~.callback.IncrementalCheckpoint` (a callback that saves at its
own save points and resumes by itself) and :class:`~.checkpoint_io.IncrementalCheckpointIO`
(every ``trainer.save_checkpoint`` through the engine), over the engine and the runtime.

Every use of Lightning's internals is behind :mod:`.compat`. Importing this package imports
Lightning; ``lightning_incremental.core`` and ``lightning_incremental.runtime`` never do.
"""
