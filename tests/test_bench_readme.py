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
