"""bench.profile_summary reads py-spy's raw stacks as `bench_hw --profile` leaves them.

py-spy itself does not run in this suite (it is not installed here); the lines below
are in the format it writes with `--threads --format raw` (copied from a GPU run)."""

from bench.profile_summary import main, parse, summary

ENGINE = ("thread (985): kvroute-engine;Thread._bootstrap (threading.py:1030);"
          "Engine._run (kvroute/backend/engine.py:371);"
          "GenerationBatch._step (mlx_lm/generate.py:1434);eval (<native>:0)")
WRITER = ("thread (984): kvroute-disk-write;Thread._bootstrap (threading.py:1030);"
          "DiskTier._write_loop (kvroute/backend/disk.py:505);"
          "DiskTier._hold_off (kvroute/backend/disk.py:717)")
LOOP = "thread (779): MainThread;_run_module_as_main (<frozen runpy>:198);run_async (kvroute/cli.py:28)"


def test_each_threads_share_and_where_it_went(tmp_path, capsys, monkeypatch):
    path = tmp_path / "kvroute-decodes-779-all.txt"
    path.write_text(f"{ENGINE} 30\n{WRITER} 10\n{LOOP} 60\n{ENGINE.replace('1434', '1439')} 10\n")
    rows = parse(path)
    assert [(t.split(": ")[1], n) for t, _, n in rows] == [
        ("kvroute-engine", 30), ("kvroute-disk-write", 10), ("MainThread", 60), ("kvroute-engine", 10)]
    text = summary(path, top=5)
    assert "110 samples" in text
    assert "- engine, thread (985): kvroute-engine: 40 samples (36%)" in text
    # The deepest frame of ours, with the leaf it called where that is not ours.
    assert "75.0%  GenerationBatch._step (mlx_lm/generate.py:1434) > eval" in text
    assert "- disk writer, thread (984): kvroute-disk-write: 10 samples (9%)" in text
    assert "100.0%  DiskTier._hold_off (kvroute/backend/disk.py:717)" in text

    monkeypatch.setattr("sys.argv", ["profile_summary", str(tmp_path), "--match", "decodes"])
    main()
    assert "kvroute-decodes-779-all.txt: 110 samples" in capsys.readouterr().out
