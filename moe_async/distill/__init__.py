"""On-policy distillation: the student's engines sample, a teacher pool scores every sampled
token (SGLang's ``/generate`` with the student's token ids, ``max_new_tokens: 0``), and the
per-token reverse KL becomes the advantage (:mod:`.advantages`); with the teacher's top-k, the
trainer adds a top-k forward KL loss term (:func:`moe_async.trainer.loss.topk_forward_kl`)."""
