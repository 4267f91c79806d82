"""``arguments.md`` generated from the parser (``rl_plugin.arguments.docs``): how one flag is
rendered, and ``--check`` failing on a stale file (the repository's own file is checked in
test_arguments.py)."""

from __future__ import annotations

import argparse

from rl_plugin.arguments import build_parser, docs


def _parser():
    p = argparse.ArgumentParser()
    g = p.add_argument_group("widgets", "Settings of the widget.")
    g.add_argument("--widget-count", type=int, default=3, help="How many widgets.")
    g.add_argument("--widget-kind", choices=["a", "b"], default=None, help="Which widget.")
    g.add_argument("--use-widget", action="store_true", help="Turn it on.")
    p.add_argument_group("empty")
    return p


def test_render_lists_each_group_and_flag_with_default_and_choices():
    text = docs.render(_parser())
    assert text.startswith(docs.HEADER)
    body = text[len(docs.HEADER) :]
    assert "\n## widgets\nSettings of the widget.\n" in body
    assert "\n### `--widget-count`\n\ndefault `3`.\n\nHow many widgets.\n" in body
    assert "\n### `--widget-kind`\n\ndefault none; choices `a`, `b`.\n\nWhich widget.\n" in body
    assert "\n### `--use-widget`\n\ndefault off.\n\nTurn it on.\n" in body
    assert "## empty" not in body and "--help" not in body


def test_check_exits_1_on_a_stale_file_and_rewrite_makes_it_current(tmp_path, monkeypatch, capsys):
    path = tmp_path / "arguments.md"
    monkeypatch.setattr(docs, "DOC_PATH", path)
    assert docs.main(["--check"]) == 1  # missing
    assert "is stale: run python -m rl_plugin.arguments.docs" in capsys.readouterr().err
    path.write_text("old\n")
    assert docs.main(["--check"]) == 1
    assert docs.main([]) == 0 and path.read_text() == docs.render(build_parser())
    assert docs.main(["--check"]) == 0
