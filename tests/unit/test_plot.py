"""``megatron-ext plot`` on a synthetic signals log (no launches: the log format is the contract).

The log has two attempts: attempt 1 trains iterations 1-60 with a transient spike at 40, a NaN
loss at 50 and a torn last line (killed writer); attempt 2 is a rollback replay from 35 that
spikes at 38, only 3 iterations after its restart. The ledger tests add what the tracker
wrote (its config and events) and the incident plan of ``megatron-ext skiplist``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from megatron_ext import cli
from megatron_ext.common.files import incident_stem
from megatron_ext.common.io import JsonlAppender, atomic_write_json
from megatron_ext.common.records.ledger import config_record, read_ledger
from megatron_ext.common.records.signals import SignalRecord, SignalsWriter
from megatron_ext.common.records.spike_config import SpikeConfig
from megatron_ext.plot.draw import build_series, log_ticks, main, render

CONFIG = SpikeConfig(window=10, warmup=10, patience=5)
DETECTOR_FLAGS = ["--spike-window", "10", "--spike-warmup", "10", "--spike-patience", "5"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(iteration: int, loss: float, grad: float) -> SignalRecord:
    return SignalRecord(
        iteration=iteration,
        attempt=0,
        job_id="j",
        wall_time=float(iteration),
        consumed_samples=8 * iteration,
        skipped_samples=0,
        lm_loss=loss,
        grad_norm=grad,
        params_norm=100.0 + 0.01 * iteration,
        max_loss_dp_rank=iteration % 4,
    )


def _healthy_loss(iteration: int) -> float:
    return 4.0 - 0.01 * iteration + 0.02 * math.sin(iteration)  # slow decline, a little noise


def _write_log(directory: Path) -> Path:
    first = SignalsWriter(directory)
    for i in range(1, 61):
        loss, grad = _healthy_loss(i), 1.0 + 0.05 * math.cos(i)
        if i == 40:
            loss, grad = 9.0, 20.0  # corroborated spike, back to normal at 41
        if i == 50:
            loss = math.nan
        first.write(_record(i, loss, grad))
    with open(first.path, "a") as f:
        f.write('{"iteration": 61, "attem')  # kill -9 mid-line
    second = SignalsWriter(directory)  # rollback to the checkpoint of iteration 34
    for i in range(35, 61):
        loss, grad = (8.0, 15.0) if i == 38 else (_healthy_loss(i), 1.0)
        second.write(_record(i, loss, grad))
    return first.path


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return _write_log(tmp_path / "signals")


def _series(path: Path, attempts: str = "all", *args, **kwargs) -> list:
    with pytest.warns(UserWarning, match="torn"):
        return build_series(path, attempts, CONFIG, *args, **kwargs)[0]


def _iterations(series) -> list[int]:
    return series.envelopes["lm_loss"].points()[0].tolist()


def _marks(series) -> list[tuple[str, int]]:
    return [(e.kind, e.iteration) for e in series.candidates]


def test_each_attempt_is_a_line_with_its_own_candidates(log: Path) -> None:
    first, second = _series(log)
    assert (first.label, second.label) == ("attempt 1", "attempt 2")
    assert _iterations(first) == list(range(1, 61))
    assert _iterations(second) == list(range(35, 61))
    assert _marks(first) == [("spike", 40), ("divergence", 50)]
    # Armed by attempt 1's iterations 1-34, as the tracker was when the replay started.
    assert _marks(second) == [("spike", 38)]
    assert second.candidates[0].window[0]["iteration"] < 35


def test_latest_view_marks_only_what_the_run_finally_trained(log: Path) -> None:
    (latest,) = _series(log, "latest")
    assert latest.pieces == [(1, 1, 34), (2, 35, 60)]  # (attempt, first, last iteration)
    assert _iterations(latest) == list(range(1, 61))
    assert _marks(latest) == [("spike", 38)]


def test_attempt_selection(log: Path) -> None:
    (only,) = _series(log, "2")
    assert only.label == "attempt 2" and _marks(only) == [("spike", 38)]
    assert [s.label for s in _series(log, "2,1")] == ["attempt 1", "attempt 2"]
    with pytest.raises(ValueError, match=r"no attempt \[3\].*present: \[1, 2\]"):
        build_series(log, "1,3", CONFIG)
    with pytest.raises(ValueError, match="all, latest or N"):
        build_series(log, "first", CONFIG)


def _titles(figure) -> list[str]:
    return [axis.get_title(loc="left") for axis in figure.axes]


def test_an_unrecorded_optional_panel_is_left_out_and_its_flag_named(log: Path) -> None:
    figure = render(_series(log), "t")
    assert _titles(figure) == ["LM loss", "grad norm (pre-clip)", "params norm"]
    assert not any(axis.texts for axis in figure.axes)
    assert figure.axes[1].get_yscale() == "log"
    note = figure.get_suptitle()
    assert "not recorded: max attention logit (--signals-attention-logit" in note
    assert "log Z of the output softmax (--log-output-z)" in note
    lines = log.read_text().splitlines(keepends=True)
    for number in range(5):  # the attention logit recorded at iterations 1-5, log Z at 1-60
        lines[number] = lines[number].replace(':null,"skipped_iter', ':30.0,"skipped_iter')
    lines = [line.replace('"log_z":null', '"log_z":2.5') for line in lines]
    log.write_text("".join(lines))
    figure = render(_series(log), "t")
    assert _titles(figure)[3:] == ["max attention logit", "log Z of the output softmax"]
    assert not figure.axes[3].texts and "not recorded" not in figure.get_suptitle()
    assert figure.axes[4].lines[0].get_ydata()[:3].tolist() == [2.5, 2.5, 2.5]


def test_the_grad_norm_axis_is_labelled_within_a_decade(tmp_path: Path) -> None:
    """A healthy grad norm stays within a decade (the demo's: 0.9-1.7): matplotlib's log axis
    labelled it twice (1 and 9x10^-1); round numbers now, four at least."""
    writer = SignalsWriter(tmp_path)
    for i in range(1, 41):
        writer.write(_record(i, _healthy_loss(i), 0.9 + 0.8 * abs(math.sin(i / 7))))
    (line,) = build_series(writer.path, "all", CONFIG)[0]
    figure = render([line], "t")
    FigureCanvasAgg(figure).draw()
    axis = figure.axes[1]
    low, high = axis.get_ylim()
    labels = [t for t in axis.yaxis.get_majorticklabels() if t.get_text()]
    shown = [t for t in labels if low <= t.get_position()[1] <= high]
    assert axis.get_yscale() == "log" and len(shown) >= 4, [t.get_text() for t in shown]
    assert all("times" not in t.get_text() for t in shown)  # 1.2, not 1.2x10^0
    assert log_ticks(0.9, 2.7) == [1.2, 1.6, 2.0, 2.4]  # 1, 1.5, 2: too few
    assert log_ticks(0.01, 50.0) == []  # past two decades: matplotlib's powers of ten


def test_withheld_updates_are_marked_and_counted(tmp_path: Path) -> None:
    writer = SignalsWriter(tmp_path)
    for i in range(1, 41):
        record = _record(i, _healthy_loss(i), 1.0)
        record.update_skipped = record.skipped_iter = i in (12, 13, 30)
        writer.write(record)
    (line,) = build_series(writer.path, "all", CONFIG)[0]
    assert line.update_skips == 3
    figure = render([line], "t")
    diamonds = [mark for mark in figure.axes[0].lines if mark.get_marker() == "D"]
    assert [d.get_xdata().tolist() for d in diamonds] == [[12, 13, 30]]
    labels = [t.get_text() for t in figure.legends[0].get_texts()]
    assert "update withheld (3, loss panel's bottom edge)" in labels


def test_cli_writes_a_png_atomically(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="torn"):
        assert main(["--signals-dir", str(log.parent), *DETECTOR_FLAGS]) == 0
    out = log.parent / "signals.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1200, 1100)
    assert sorted(p.name for p in log.parent.iterdir()) == ["signals.jsonl", "signals.png"]
    printed = capsys.readouterr().out
    assert "3 spike/divergence candidate(s)" in printed
    assert "iteration       40 attempt 1: spike" in printed


def test_cli_signals_file_default_and_explicit_out(log: Path, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="torn"):
        assert main(["--signals", str(log), "--attempts", "latest"]) == 0
    assert log.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    with pytest.warns(UserWarning, match="torn"):
        assert main(["--signals", str(log), "--out", str(tmp_path / "a" / "b.png")]) == 0
    assert (tmp_path / "a" / "b.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_refusals(tmp_path: Path, log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--signals-dir", str(tmp_path / "nowhere")]) == 1
    assert "not found (was the run started with --signals-dir?)" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["--signals", str(tmp_path / "empty.jsonl")]) == 1
    assert "holds no signals records" in capsys.readouterr().err
    (tmp_path / "foreign.jsonl").write_text('{"step": 1}\n')
    with pytest.warns(UserWarning, match="not signals records"):
        assert main(["--signals", str(tmp_path / "foreign.jsonl")]) == 1
    assert "holds no signals records" in capsys.readouterr().err
    assert main(["--signals", str(log), "--attempts", "7"]) == 1  # refused before reading
    assert "no attempt [7]" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_an_out_that_cannot_be_written_is_refused_and_no_log_is_overwritten(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _ledger(log, tmp_path / "ckpt")
    kept = {p: p.read_bytes() for p in (log, log.parent / "spikes.jsonl")}
    for out in kept:  # a typo: the log itself, or the ledger beside it
        assert main(["--signals", str(log), "--out", str(out)]) == 1
        assert f"--out {out} is a log this plot reads" in capsys.readouterr().err
    (tmp_path / "a_dir").mkdir()
    assert main(["--signals", str(log), "--out", str(tmp_path / "a_dir")]) == 1
    assert "is a directory; name a .png file" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="torn"):  # its folder is a file: not writable
        assert main(["--signals", str(log), "--out", str(log / "plot.png")]) == 1
    assert f"cannot write {log / 'plot.png'}" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(p.name for p in log.parent.iterdir()) == ["signals.jsonl", "spikes.jsonl"]
    assert not list((tmp_path / "a_dir").iterdir())


def test_records_rewritten_in_another_key_order_are_refused_as_such(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [json.loads(line) for line in log.read_text().splitlines()[:60]]
    log.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    assert main(["--signals", str(log)]) == 1
    err = capsys.readouterr().err
    assert 'do not start {"iteration":N,"attempt":M,' in err and "holds no" not in err
    assert not log.with_suffix(".png").exists()


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--signals-dir", "a", "--signals", "b"],
        ["--signals-dir", "a", "--spike-window", "2"],
    ],
)
def test_cli_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2


def test_dispatched_by_the_console_script(log: Path) -> None:
    assert "plot" in cli.COMMANDS and "\n  plot " in cli.USAGE
    with pytest.warns(UserWarning, match="torn"):
        assert cli.main(["plot", "--signals-dir", str(log.parent), *DETECTOR_FLAGS]) == 0


def _ledger(log: Path, ckpt: Path) -> None:
    """What the tracker of attempt 1 wrote (window 10 etc.), and one plan."""
    ledger = JsonlAppender(log.parent / "spikes.jsonl")
    ledger.append(config_record(1, 1, CONFIG, str(ckpt), None))
    for kind, iteration in (("spike", 40), ("recovered", 41), ("divergence", 50), ("rollback", 50)):
        ledger.append(
            {
                "iteration": iteration,
                "kind": kind,
                "onset": iteration,
                "attempt": 1,
                "consumed_samples": 8 * iteration,
                "culprit_dp_rank": 0,
                "loss": 1.0,
                "loss_baseline": 1.0,
                "loss_threshold": 1.1,
                "grad_norm": 1.0,
                "grad_baseline": 1.0,
                "classification": "test",
            }
        )
    plan = {"onset": 50, "rollback_to": 34, "skip_window": [35, 46], "incident": {}}
    atomic_write_json(incident_stem(ckpt, 1).with_suffix(".json"), plan)


def test_the_tracker_s_own_events_settings_and_plans_are_shown(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _ledger(log, tmp_path / "ckpt")
    assert read_ledger(log.parent / "spikes.jsonl").config(2) == CONFIG  # attempt 2: inherited
    with pytest.warns(UserWarning, match="torn"):
        assert main(["--signals-dir", str(log.parent)]) == 0  # no flags: the run's settings
    printed = capsys.readouterr().out
    assert "4 tracker event(s)" in printed and "1 incident plan(s)" in printed
    assert "replayed with SpikeConfig(window=10, warmup=10" in printed  # not the defaults
    assert "incident 1: onset 50, rollback to 34, skip window [35, 46]" in printed
    # Attempt 1 wrote a config line: its marks are the ledger's; attempt 2 is replayed.
    ledger = read_ledger(log.parent / "spikes.jsonl")
    first, second = _series(log, "all", ledger)
    assert (first.source, second.source) == ("ledger", "replay")
    assert _marks(first) == [("spike", 40), ("recovered", 41), ("divergence", 50), ("rollback", 50)]
    assert _marks(second) == [("spike", 38)]
    # A --spike-* flag asks for a replay of every attempt with those thresholds.
    replayed = _series(log, "all", ledger, replay=True)
    assert [s.source for s in replayed] == ["replay", "replay"]


def test_rollback_target_and_skip_window_are_drawn(log: Path, tmp_path: Path) -> None:
    _ledger(log, tmp_path / "ckpt")
    plan = {"number": 1, "onset": 50, "rollback_to": 34, "skip_window": [35, 46]}
    figure = render(_series(log), "t", [plan])
    for axis in figure.axes:
        spans = [p for p in axis.patches if p.get_x() == 34.5]
        assert len(spans) == 1 and spans[0].get_width() == 12  # iterations 35..46
        assert 34 in [line.get_xdata()[0] for line in axis.lines if line.get_linestyle() == "--"]
    assert "rollback to 34, skip 35-46" in figure.axes[0].texts[-1].get_text()


def _blend_log(directory: Path) -> Path:
    """Stage 1 (attempt 1, 1-40): prose 90 %, code 10 %; stage 2 (attempt 2, resumed at 41):
    the weights inverted. Each source keeps its own loss; the average moves."""
    for attempt, (prose, code) in enumerate(((900, 100), (100, 900)), start=1):
        writer = SignalsWriter(directory)
        for i in range(1 + 40 * (attempt - 1), 41 + 40 * (attempt - 1)):
            losses = {"prose": 2.0 + 0.01 * math.sin(i), "code": 3.0 + 0.01 * math.cos(i)}
            record = _record(i, (2.0 * prose + 3.0 * code) / 1000, 1.0)
            record.lm_loss_by_dataset = losses
            record.tokens_by_dataset = {"prose": prose, "code": code}
            writer.write(record)
    return directory / "signals.jsonl"


def test_the_per_source_panel_has_a_line_per_source_and_marks_the_stage_change(
    tmp_path: Path,
) -> None:
    from megatron_ext.plot.stream import stage_changes

    path = _blend_log(tmp_path)
    (line,) = build_series(path, "latest", CONFIG)[0]
    assert sorted(line.sources.envelopes) == ["code", "prose"]
    xs, ys = line.sources.envelopes["code"].points()
    assert list(xs) == list(range(1, 81)) and all(abs(y - 3.0) < 0.02 for y in ys)
    assert stage_changes(line.pieces, line.sources.mixtures) == [(41, "stage: code 90%, prose 10%")]
    # The replayed detector reads the sources too: the stage change flags nothing.
    assert [e for e in line.candidates if e.kind == "spike"] == []
    figure = render([line], "blend")
    assert len(figure.axes) == 4  # loss, grad norm, params norm (nothing optional recorded)
    assert figure.axes[-1].get_title(loc="left") == "LM loss by data source"
    assert [t.get_text() for t in figure.axes[-1].texts] == ["stage: code 90%, prose 10%"]
    # A log without per-source fields has no such panel.
    (plain,) = build_series(_write_log(tmp_path / "plain"), "latest", CONFIG)[0]
    assert len(render([plain], "plain").axes) == 3


def test_the_per_layer_panels_have_a_line_per_layer_in_model_order(tmp_path: Path) -> None:
    """--log-layer-norms' fields (a non-finite value included) become one panel each, a line
    per layer entry in model order, read by the columnar reader."""
    writer = SignalsWriter(tmp_path)
    names = ["output_layer", "decoder.layers.10", "decoder.layers.2", "embedding.word_embeddings"]
    for i in range(1, 31):
        record = _record(i, _healthy_loss(i), 1.0)
        record.layer_grad_norms = {n: 0.1 * (k + 1) + 0.001 * i for k, n in enumerate(names)}
        record.layer_param_norms = {n: 10.0 + k for k, n in enumerate(names)}
        if i == 20:
            record.layer_grad_norms["decoder.layers.2"] = math.inf
        writer.write(record)
    series, _ = build_series(writer.path, "all", CONFIG)
    figure = render(series, "t")
    titles = _titles(figure)
    assert titles[-2:] == ["grad norm per layer (pre-clip)", "weights' norm per layer"]
    grad_axis = figure.axes[titles.index("grad norm per layer (pre-clip)")]
    order = ["embedding.word_embeddings", "decoder.layers.2", "decoder.layers.10", "output_layer"]
    assert [line.get_label() for line in grad_axis.lines] == order
    second = grad_axis.lines[1].get_ydata()  # decoder.layers.2: the inf is a break (NaN)
    assert len(second) == 30 and math.isnan(second[19]) and second[0] == pytest.approx(0.301)
    layers = series[0].layers["layer_grad_norms"]
    assert layers["decoder.layers.2"].bad().tolist() == [20]
