"""The Megatron-Core runtime shared by the trainer and the checkpoint converters.

Modules (none is imported by this package's ``__init__``; import the one you need):

- ``parallel``: the frozen layout (TP/PP/EP/ETP/CP/VPP) and its checks, process-group
  setup/teardown, the Transformer Engine probe, the free-port helper;
- ``build``: model chunks (``GPTModel``) from a family, an HF config and the parallel state;
- ``hf_io``: HF safetensors/config input and the streaming HF load;
- ``export``: full HF tensors out of the model chunks, the sharded safetensors writer;
- ``dist_ckpt``: torch_dist save/load strategies, checkpoint file checks, metadata;
- ``convert``: HF <-> Megatron conversions composed from the above;
- ``tool_args``: the converter CLIs' torch-free part (refusal as one error line, size and
  output-dir checks).
"""
