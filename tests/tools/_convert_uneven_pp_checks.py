"""Uneven pipeline stages in the converters: a 4-layer tiny Mixtral (untied) converted HF ->
torch_dist at PP2 with 3 + 1 layers, loaded by MegatronTrainer at that uneven PP2 and at PP1,
and converted back to HF at both; one function per launch of _convert_launches.py, the
results returned as dicts, every path under TMP.

    make_hf(TMP)   (prep, before Megatron is imported)
        the HF checkpoints ``src`` and ``other`` (another seed; the trainers are built from it,
        so only the load makes them equal ``src``).
    w2(TMP)   (2 ranks, the gloo process group already initialised)
        the CLI ``main`` converts ``src`` at --pp 2 --num-layers-in-first-pipeline-stage 3
        (``meg``); a trainer at the same uneven PP2 loads it (its layer numbers per rank, its
        exported checksums); ``meg`` back to HF at that uneven PP2 (``back_pp2``).
    w1(TMP)   (1 process)
        a trainer at PP1 loads ``meg`` (checksums); ``meg`` back to HF at PP1 (``back_pp1``);
        the source and both round trips' checksums, the conversion metadata and Megatron-LM's
        args saved in ``common.pt``.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def _cfg(**fields):
    from moe_async.trainer.config import TrainerConfig

    return TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, **fields)


def _checksums(d: str) -> dict:
    from moe_async.models import tensor_checksum
    from moe_async.megatron.hf_io import iter_hf_tensors

    return {k: tensor_checksum(t) for k, t in iter_hf_tensors(d)}


def make_hf(tmp: str) -> None:
    from _tiny import make_tiny_mixtral

    make_tiny_mixtral(os.path.join(tmp, "src"), tie=False, seed=3, num_hidden_layers=4)
    make_tiny_mixtral(os.path.join(tmp, "other"), tie=False, seed=4, num_hidden_layers=4)


def w2(tmp: str) -> dict:
    import convert_hf_to_megatron as h2m_cli
    import convert_megatron_to_hf as m2h_cli
    from _checks import gather

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    src, meg = os.path.join(tmp, "src"), os.path.join(tmp, "meg")
    h2m_cli.main(["--hf", src, "--out", meg, "--pp", "2", "--num-layers-in-first-pipeline-stage", "3",
                  "--no-progress"])
    res: dict = {}
    tr = MegatronTrainer(_cfg(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3),
                         os.path.join(tmp, "other"))
    tr.load_checkpoint(meg)
    res["stage_layers"] = gather([lay.layer_number for lay in tr.model.decoder.layers])
    res["trainer_pp2"] = tr.hf_checksums()
    tr.close()
    m2h_cli.main(["--megatron", meg, "--hf-config", src, "--out", os.path.join(tmp, "back_pp2"), "--pp", "2",
                  "--num-layers-in-last-pipeline-stage", "1", "--no-progress"])
    return res


def w1(tmp: str) -> dict:
    import convert_megatron_to_hf as m2h_cli

    from moe_async.megatron.container import resolve
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    src, meg = os.path.join(tmp, "src"), os.path.join(tmp, "meg")
    tr = MegatronTrainer(_cfg(), os.path.join(tmp, "other"))
    tr.load_checkpoint(meg)
    res: dict = {"trainer_pp1": tr.hf_checksums()}
    tr.close()
    m2h_cli.main(["--megatron", meg, "--hf-config", src, "--out", os.path.join(tmp, "back_pp1"), "--no-progress"])
    res.update(src=_checksums(src), back_pp1=_checksums(os.path.join(tmp, "back_pp1")),
               back_pp2=_checksums(os.path.join(tmp, "back_pp2")))
    with open(os.path.join(resolve(meg), "moe_async_convert.json")) as f:
        res["saved_layout"] = json.load(f)["saved_layout"]
    args = torch.load(os.path.join(resolve(meg), "common.pt"), weights_only=False)["args"]
    res["mlm_args"] = [args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                       args.pipeline_model_parallel_size]
    return res
