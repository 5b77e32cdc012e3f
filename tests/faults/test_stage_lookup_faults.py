"""A resume that changes the blend (a new stage of the mixture), then the lookup of an
iteration of the earlier stage from the newest checkpoint, in real training launches.

Two tiny launches in one run directory (DP=1, 8 iterations, global batch 8, checkpoint every
4): stage 1 trains 1-4 on the blend 0.2 / 0.8 of two prefixes and exits at 4; stage 2 resumes
with the weights inverted (0.8 / 0.2) and trains 5-8. The lookup reads iter_0000008, whose
args hold stage 2's blend.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.common.files import LAYOUT_FILE
from megatron_ext.common.records.sample_log import read_records
from megatron_ext.lookup import cli
from tests.support.faults import fault
from tests.support.harness import launch

pytestmark = pytest.mark.e2e

STAGES = {1: ("0.2", "0.8"), 2: ("0.8", "0.2")}


@pytest.fixture(scope="module")
def stages(tmp_path_factory, data_args) -> dict:
    root = tmp_path_factory.mktemp("stages")
    document = data_args[data_args.index("--data-path") + 1]
    copy = root / "copy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(document + suffix, str(copy) + suffix)
    ckpt, work = root / "ckpt", root / "run"

    def blend(stage: int) -> list[str]:
        data = list(data_args)
        at = data.index("--data-path")
        first, second = STAGES[stage]
        data[at + 1 : at + 2] = [first, document, second, str(copy)]
        data[data.index("--data-cache-path") + 1] = str(root / "index-cache")
        return data

    common = ["--train-iters", "8", "--save", str(ckpt), "--load", str(ckpt)]
    for stage, more in ((1, ["--exit-interval", "4"]), (2, [])):
        result = launch(work, [*blend(stage), *common, "--save-interval", "4", *more])
        assert result.returncode == 0, result.log[-4000:]
    recorded = {
        (r.iteration, r.microbatch): (r.sample_ids, r.token_sha1)
        for r in read_records(work / "samples" / "samples-dp0.jsonl")
    }
    return {"ckpt": ckpt, "samples": work / "samples", "recorded": recorded, "blend": blend}


def _answer(capsys, ckpt: Path, iteration: int, *extra: str) -> dict:
    code = cli.main(
        ["--from-checkpoint", str(ckpt), "--iteration", str(iteration), "--json", *extra]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _slots(answer: dict) -> dict[tuple[int, int], tuple[list[int], list[str]]]:
    slots: dict[tuple[int, int], tuple[list[int], list[str]]] = {}
    for sample in answer["samples"]:
        ids, digests = slots.setdefault(
            (answer["batch"]["iteration"], sample["microbatch"]), ([], [])
        )
        ids.append(sample["sample_index"])
        digests.append(sample["token_sha1"])
    return slots


@fault(
    "a resume that changes the blend (0.2/0.8 -> 0.8/0.2), then `lookup` of every iteration "
    "from the newest checkpoint; then the earlier stage's checkpoint deleted",
    "each iteration answered with the data configuration in force then, found by the lookup "
    "itself (that stage's checkpoint, else the layout log) and said in a note, equal to the "
    "sample log of that stretch; the later stage's blend would not match",
    area="lookup",
)
def test_lookup_uses_the_blend_of_each_stage(stages, tmp_path, capsys) -> None:
    recorded, samples = stages["recorded"], str(stages["samples"])
    for iteration in range(1, 9):
        answer = _answer(capsys, stages["ckpt"], iteration)
        expected = {k: v for k, v in recorded.items() if k[0] == iteration}
        assert _slots(answer) == expected != {}, iteration
        stage_notes = [n for n in answer["notes"] if "the data changed at a resume" in n]
        if iteration <= 4:
            assert len(stage_notes) == 1 and "from checkpoint iter_0000004" in stage_notes[0]
            assert "'0.2'" in stage_notes[0] and "'0.8'" in stage_notes[0]
        else:
            assert stage_notes == []
    answer = _answer(capsys, stages["ckpt"], 2, "--sample-log", samples)
    assert "sample log: 4 micro-batches match the training record" in " ".join(answer["lines"])
    # The blend of the checkpoint read (stage 2) is not what iteration 2 trained on.
    later_blend = stages["blend"](2)[:5]
    assert later_blend[0] == "--data-path" and later_blend[1] == STAGES[2][0]
    argv = ["--from-checkpoint", str(stages["ckpt"]), "--iteration", "2", "--sample-log", samples]
    assert cli.main([*argv, *later_blend]) == 1
    assert "the data changed since training" in capsys.readouterr().err
    # Stage 1's checkpoint deleted: its blend comes from the layout log.
    ckpt = shutil.copytree(stages["ckpt"], tmp_path / "ckpt")
    shutil.rmtree(ckpt / "iter_0000004")
    answer = _answer(capsys, ckpt, 3, "--sample-log", samples)
    assert _slots(answer) == {k: v for k, v in recorded.items() if k[0] == 3}
    assert any(f"{LAYOUT_FILE} line 1 (no checkpoint of that stage" in n for n in answer["notes"])


@fault(
    "the earlier stage's checkpoint deleted and its layout-log line without data fields (as "
    "an older version wrote it), then `lookup` of an iteration of that stage",
    "refused (exit 1): no record of that stage's data configuration survives; says which "
    "flags to pass; the later stage still answered",
    area="lookup",
)
def test_lookup_refuses_a_stage_no_record_of_which_survives(stages, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(stages["ckpt"], tmp_path / "ckpt")
    shutil.rmtree(ckpt / "iter_0000004")
    samples = shutil.copytree(stages["samples"], tmp_path / "samples")
    lines = [json.loads(line) for line in (samples / LAYOUT_FILE).read_text().splitlines()]
    for name in ("data_path", "split", "seed", "seq_length", "dataloader_type"):
        del lines[0][name]
    (samples / LAYOUT_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["--from-checkpoint", str(ckpt), "--sample-log", str(samples), "--iteration"]
    assert cli.main([*argv, "2"]) == 1
    err = capsys.readouterr().err
    assert "no record of the data configuration of iterations 1.." in err, err
    assert "Pass that stage's data flags (--data-path" in err and "Traceback" not in err
    assert cli.main([*argv, "6"]) == 0, capsys.readouterr().err
