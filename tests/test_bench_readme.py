"""``python -m bench.readme``: finds the modules that publish rows and rewrites only its table
(in docs/benchmarks.md)."""

from __future__ import annotations

from bench import readme


def test_the_modules_that_define_readme_rows_are_found() -> None:
    names = readme.publishers()
    assert {"bench_appends", "bench_restore"} <= set(names)
    assert "corpus" not in names


def test_the_table_between_the_markers_is_replaced_and_its_rows_read_back() -> None:
    text = f"intro\n{readme.START}\nold\n{readme.END}\nafter\n"
    rows = [("bench_x", ("goal ≤ 2x", "1.5 s = 0.9x", "raw 1.6 s"))]
    rewritten = readme.rewrite(text, readme.table(rows, "note"))
    assert rewritten.startswith("intro\n")
    assert rewritten.endswith(f"{readme.END}\nafter\n")
    assert "old" not in rewritten
    assert readme.kept_rows(rewritten) == rows


def test_a_row_whose_text_holds_a_bar_is_read_back_whole() -> None:
    rows = [("bench_x", ("goal ≤ 2x", "joined by <|endoftext|>", "raw 1.6 s"))]
    text = readme.rewrite(f"{readme.START}\n{readme.END}\n", readme.table(rows, "note"))
    assert readme.kept_rows(text) == [
        ("bench_x", ("goal ≤ 2x", "joined by </endoftext/>", "raw 1.6 s"))
    ]


def test_the_benchmarks_page_has_the_markers_and_names_the_command() -> None:
    text = readme.PAGE.read_text(encoding="utf-8")
    assert "`python -m bench.readme`" in text[: text.index(readme.START)]
    assert text.index(readme.START) < text.index(readme.END)


def test_each_module_keeps_its_own_stamp_when_another_is_rerun() -> None:
    names = ["bench_a", "bench_b"]
    first = {"bench_a": "2026-12-01, load average 1.0, 2.0, 3.0", "bench_b": readme.stamp_now()}
    rows = [("bench_a", ("goal", "measured", "reference"))]
    page = readme.rewrite(
        f"{readme.START}\n{readme.END}\n", readme.table(rows, readme.note(first, names))
    )
    stamps = readme.kept_stamps(page)
    assert stamps == first
    stamps["bench_b"] = "2026-12-05, load average 0.2, 0.3, 0.4"  # bench_b rerun alone
    again = readme.rewrite(page, readme.table(rows, readme.note(stamps, names)))
    assert readme.kept_stamps(again) == {
        "bench_a": "2026-12-01, load average 1.0, 2.0, 3.0",
        "bench_b": "2026-12-05, load average 0.2, 0.3, 0.4",
    }
    assert "`python -m bench.readme`" in readme.note(stamps, names)


def test_the_page_stamps_every_module_that_publishes_rows() -> None:
    text = readme.PAGE.read_text(encoding="utf-8")
    assert set(readme.kept_stamps(text)) == set(readme.publishers())
