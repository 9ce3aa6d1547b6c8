"""benchmarks/experiments/goal_readings.py: the goal lines of beside_writer.py's readings gathered into ranges and
counts, against figures written out here for hand-made readings."""

from benchmarks.experiments import goal_readings

RUN = """iteration 9: 5.93 s beside the writer of checkpoint 8 (update 4.05 + rest 1.88), 4.82 s without saves (update 3.57 + rest 1.26): {first}x
  iteration 9's disk: read 4.08 GB, wrote 9.21 GB (without saves: read 4.33, wrote 4.86): 9.99x
iteration 10: 5.35 s beside the writer of checkpoint 8 (update 4.14 + rest 1.21), 5.09 s without saves (update 3.86 + rest 1.23): {second}x
iterations 9-16 (after the first save) together: {after}x the run without saves
iterations 2-8 (before the first save) together: 0.98x the run without saves
save at 8: held {hold} s
save at 16: held 0.37 s
worst iteration beside the writer: {worst}x the run without saves (met: goal <= 1.25x)
iterations 9-10 beside the writer against the median of the same without saves (4.82 s; that run's own 0.96-1.06x of it): worst {median}x, mean 1.12x
"""


def write(tmp_path, name, **figures):
    path = tmp_path / name
    path.write_text(RUN.format(**figures))
    return str(path)


def test_one_reading_is_read_line_by_line():
    r = goal_readings.reading(RUN.format(first=1.23, second=1.05, after=1.16, hold=0.27, worst=1.23, median=1.21))
    assert r == {"holds": [0.27, 0.37], "worst": 1.23, "worst_at": 9, "first_after_save": True, "worst_median": 1.21,
                 "mean_median": 1.12, "after": 1.16, "before": 0.98}


def test_runs_gather_into_ranges_and_counts_at_the_goals(tmp_path, capsys):
    a = write(tmp_path, "a.txt", first=1.10, second=1.30, after=1.05, hold=0.61, worst=1.30, median=1.28)
    b = write(tmp_path, "b.txt", first=1.20, second=1.05, after=1.16, hold=0.27, worst=1.20, median=1.19)
    none = tmp_path / "c.txt"
    none.write_text("iterations 2-8 (before the first save) together: 0.98x the run without saves\n")
    goal_readings.main([a, b, str(none)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{none}: no worst step (not a reading of a run with saves)"
    assert out[1].startswith(f"{a}: holds 0.61, 0.37 s; worst step 1.30x (iteration 10)")
    assert out[-1] == ("2 runs: holds 0.27-0.61 s (3 of 4 <= 0.5 s); worst step 1.20-1.30x (1 of 2 <= 1.25x), against "
                       "the median 1.19-1.28x (1 of 2); the steps after the first save together 1.05-1.16x; the worst "
                       "step the first after a save in 1 of 2")
