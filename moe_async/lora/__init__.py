"""LoRA for the Megatron trainer: the ``trainer.lora`` config, adapters on Megatron-Core's
parallel linears (TP-sharded as Megatron-Bridge does), and the Hugging Face PEFT export."""
