"""Data-parallel training on DeepSpeed ZeRO, behind the training loops' strategy interface.

- ``zero``: the DeepSpeed strategy and its factory (the only module that imports deepspeed).
- ``deepspeed_config``: checks of a DeepSpeed JSON and its "auto" fields (no deepspeed import).

Import from the modules themselves (``from rlhf_core.distributed.zero import DeepSpeedFactory``).
"""
