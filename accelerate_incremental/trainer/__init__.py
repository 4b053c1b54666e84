"""The Hugging Face ``Trainer`` adapter: a ``transformers.Trainer`` saves its ``checkpoint-N``
folders through the store and resumes from it bit-exact (see :mod:`.enable`, the entry point
:func:`enable_trainer`, and :mod:`.checkpointer`, what it hooks). Every transformers internal it
relies on is behind :mod:`.hf_compat`. It builds on the Accelerate adapter (the accelerator a
Trainer owns), never the other way round but for the launch flag, which installs it."""

from accelerate_incremental.trainer.enable import enable_trainer

__all__ = ["enable_trainer"]
