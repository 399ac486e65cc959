"""Uneven pipeline stages in tools/convert_*.py: HF -> torch_dist at PP2 with 3 + 1 layers
(--num-layers-in-first-pipeline-stage 3), loaded by MegatronTrainer at the same uneven PP2 and
at PP1, and back to HF at both: every tensor bit-equal to the source; the stage sizes are
recorded in moe_async_convert.json and in Megatron-LM's args. Stage sizes that do not fit
the model are refused naming the flag, before anything is written. The checks
(_convert_uneven_pp_checks.py) run in the 2-process torchrun and the final process shared with
test_convert.py (conftest.py's ``convert_results``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _cli import cli_in_process

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo conversion checks")


@pytest.fixture(scope="module")
def res(convert_results):
    return convert_results["uneven_pp"]


def test_layers_split_three_and_one(res):
    assert res["stage_layers"] == [[1, 2, 3], [4]]


@pytest.mark.parametrize("key", ["trainer_pp2", "trainer_pp1", "back_pp2", "back_pp1"])
def test_every_tensor_bit_equal_to_source(res, key):
    src = res["src"]
    assert len(src) > 20  # 4 layers x (attention, norms, router, 4 experts) + embeddings
    assert res[key] == src, sorted(k for k in src if res[key].get(k) != src[k])[:5]


def test_stage_sizes_recorded(res):
    lay = res["saved_layout"]
    assert (lay["pp"], lay["num_layers_in_first_pipeline_stage"], lay["num_layers_in_last_pipeline_stage"]) \
        == (2, 3, None)
    assert res["mlm_args"] == [3, None, 2]  # Megatron-LM's decoder_first/last_pipeline_num_layers


@pytest.fixture(scope="module")
def mix4(tmp_path_factory) -> str:
    from _tiny import make_tiny_mixtral

    return make_tiny_mixtral(str(tmp_path_factory.mktemp("mix4") / "hf"), tie=False, num_hidden_layers=4)


@pytest.mark.parametrize("pp,first,last,needles", [
    (2, 4, None, ["--num-layers-in-first-pipeline-stage 4 leave 0", "1 other stage(s) of --pp 2"]),
    (2, 3, 2, ["--num-layers-in-last-pipeline-stage 2 leave -1"]),
    (3, 1, None, ["leave 3 of num_hidden_layers=4 for the 2 other stage(s) of --pp 3"]),
    (1, 3, None, ["--num-layers-in-first-pipeline-stage 3 need --pp > 1"]),
    (2, 0, None, ["--num-layers-in-first-pipeline-stage must be a positive integer"]),
])
def test_stage_sizes_refused_naming_the_flag(mix4, pp, first, last, needles):
    from moe_async.models import hf_config_dict
    from moe_async.megatron.parallel import check_layout

    with pytest.raises(ValueError) as ei:
        check_layout(hf_config_dict(mix4), 1, pp, 1, world=pp, first=first, last=last)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


@pytest.mark.parametrize("pp,first,last", [(2, 3, None), (2, None, 1), (2, 1, 3), (3, 2, 1), (4, 1, 1)])
def test_stage_sizes_accepted(mix4, pp, first, last):
    from moe_async.models import hf_config_dict
    from moe_async.megatron.parallel import check_layout

    check_layout(hf_config_dict(mix4), 1, pp, 1, world=pp, first=first, last=last)  # no error


def test_cli_refusal_is_one_line_and_writes_nothing(mix4, tmp_path, capsys, monkeypatch):
    out = tmp_path / "meg"
    rc, err = cli_in_process("convert_hf_to_megatron", ["--hf", mix4, "--out", str(out), "--pp", "2",
                                                        "--num-layers-in-last-pipeline-stage", "4"], capsys, monkeypatch)
    assert rc == 2, err
    assert "convert_hf_to_megatron: error:" in err and "--num-layers-in-last-pipeline-stage 4" in err
    assert "Traceback" not in err and not out.exists()


def test_trainer_checkpoint_args_record_uneven_stages(mix4):
    """The trainer's own checkpoints record their stage sizes in Megatron-LM's args as well
    (``decoder_first/last_pipeline_num_layers``, which Megatron-Bridge's loader reads)."""
    import types

    from moe_async.megatron.container import trainer_common_state
    from moe_async.models import get_family, hf_config_dict
    from moe_async.trainer.config import TrainerConfig

    hf = hf_config_dict(mix4)
    cfg = TrainerConfig(pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1)
    tr = types.SimpleNamespace(cfg=cfg, family=get_family(hf["model_type"]), hf_config=hf, vocab_size=256, version=7)
    args = trainer_common_state(tr)["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (None, 1)
    assert args.pipeline_model_parallel_size == 2 and args.moe_grouped_gemm is False
