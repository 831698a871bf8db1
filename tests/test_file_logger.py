"""verl's trainer.logger "file": a JSON line {"step": k, "data": {...}} per logged step, appended to across runs
and cut back to the resumed step when a run resumes (the lines of steps it redoes would be there twice)."""
import json

from hybridrl.metrics import MetricsWriter


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_append_and_a_resume_drops_the_steps_it_redoes(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    first = MetricsWriter(["file"], str(tmp_path / "run"), True)
    for step in (1, 2, 3):
        first.log({"critic/score/mean": step / 10, "timing_s/step": 1.5}, step)
    first.close()  # the job stopped after step 3; its last checkpoint is step 2
    path = tmp_path / "run" / "metrics.jsonl"
    assert [line["step"] for line in _lines(path)] == [1, 2, 3]
    assert _lines(path)[0] == {"step": 1, "data": {"critic/score/mean": 0.1, "timing_s/step": 1.5}}
    again = MetricsWriter(["file"], str(tmp_path / "run"), True)
    again.resumed_at(2)
    again.log({"critic/score/mean": 0.35}, 3)
    again.close()
    assert [(line["step"], line["data"]["critic/score/mean"]) for line in _lines(path)] == [(1, 0.1), (2, 0.2), (3, 0.35)]


def test_the_path_verl_reads_from_the_environment(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere" / "m.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(target))
    writer = MetricsWriter(["file"], str(tmp_path / "run"), True)
    writer.log({"a": 1.0}, 5)
    writer.close()
    assert _lines(target) == [{"step": 5, "data": {"a": 1.0}}]
    MetricsWriter(["file"], str(tmp_path / "other"), False).close()  # ranks other than 0 write nothing
    assert not (tmp_path / "other").exists()


def test_nan_is_null_a_damaged_line_goes_and_a_fresh_start_clears(tmp_path, monkeypatch):
    """verl's orjson writes NaN as null (all-aborted batches log NaN scores); a line cut short by a crash is
    dropped at the next start instead of failing it; a run starting over at step 0 drops what an earlier attempt
    logged (verl truncates the file)."""
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    writer = MetricsWriter(["file"], str(tmp_path), True)
    writer.log({"critic/score/mean": float("nan"), "x": 1.0}, 1)
    writer.close()
    path = tmp_path / "metrics.jsonl"
    assert _lines(path) == [{"step": 1, "data": {"critic/score/mean": None, "x": 1.0}}]
    with open(path, "a") as f:
        f.write('{"step": 2, "data": {"x": ')  # the write a crash cut short
    again = MetricsWriter(["file"], str(tmp_path), True)
    again.resumed_at(1)
    again.close()
    assert [line["step"] for line in _lines(path)] == [1]
    fresh = MetricsWriter(["file"], str(tmp_path), True)
    fresh.resumed_at(0)
    fresh.log({"x": 2.0}, 1)
    fresh.close()
    assert _lines(path) == [{"step": 1, "data": {"x": 2.0}}]
