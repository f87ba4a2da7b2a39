"""A failure travels in one typed record (adapter/errors.py: Failure, on DistributedError.failure):
no module of adapter/ sets or reads its fields as ad-hoc exception attributes any more
(`exc.culprit = r`, `getattr(exc, "culprit", ...)`, `hasattr(exc, "peer")`). Backends fill the
record with with_failure / blaming and read it with failure_of / culprit_of; exc.culprit stays a
read-only view for users. Parsed, not grepped: comments and strings do not count."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from adapter.errors import DistributedError, Failure, PeerError, blaming, culprit_of, failure_of, with_failure

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("culprit", "outer_culprit", "waiting_on")  # set as attributes only on exceptions
READ_BY_NAME = FIELDS + ("peer",)  # getattr/hasattr/setattr(exc, "peer") were exceptions too


def ad_hoc_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each assignment to, or deletion of, x.culprit / x.outer_culprit /
    x.waiting_on, and each getattr/hasattr/setattr/delattr naming one of them or "peer"."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for inner in ast.walk(target):
                    if isinstance(inner, ast.Attribute) and inner.attr in FIELDS:
                        found.append((node.lineno, ast.unparse(inner)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in READ_BY_NAME):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_carries_a_failure_in_ad_hoc_attributes() -> None:
    found = []
    for path in sorted((REPO / "adapter").rglob("*.py")):
        for line, what in ad_hoc_uses(ast.parse(path.read_text(), str(path))):
            found.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not found, ("failure fields carried as ad-hoc attributes (use adapter.errors.with_failure / "
                       "blaming to fill the record, failure_of / culprit_of to read it):\n" + "\n".join(found))


def test_the_scan_finds_each_ad_hoc_form() -> None:
    """The check itself can fail: each old form is found, the record's forms are not."""
    old = ("exc.culprit = 3\nexc.culprit, exc.peer = 1, 2\ndel exc.culprit\nexc.waiting_on = [1]\n"
           "getattr(exc, 'culprit', None)\nhasattr(exc, 'peer')\nsetattr(w, 'outer_culprit', 1)\n")
    assert [line for line, _ in ad_hoc_uses(ast.parse(old))] == [1, 2, 3, 4, 5, 6, 7]
    new = "with_failure(exc, culprit=3)\nfailure_of(exc).culprit\nlink.peer = 2\nself.culprit_size = 4\n"
    assert ad_hoc_uses(ast.parse(new)) == []


def test_the_record_is_the_one_place_and_culprit_a_read_only_view() -> None:
    exc = PeerError("rank 1: all_sum: rank 2 died")
    assert exc.culprit is None and failure_of(exc) == Failure()
    with_failure(exc, culprit=2, peer=0, how="link", operation="all_reduce", sequence=7)
    assert (exc.culprit, exc.peer, exc.failure.operation, exc.failure.sequence) == (2, 0, "all_reduce", 7)
    with pytest.raises(AttributeError):
        exc.culprit = 5  # type: ignore[misc]
    # blaming keeps a culprit already named, and fills one where none is.
    assert blaming(exc, 4).culprit == 2
    assert blaming(DistributedError("x"), 4).culprit == 4
    # culprit_of follows the cause chain, then the text mark torch leaves.
    try:
        try:
            raise exc
        except PeerError:
            raise RuntimeError("wrapped by someone else")  # noqa: B904
    except RuntimeError as outer:
        assert culprit_of(outer) == 2
    assert culprit_of(RuntimeError("failed [culprit: rank 3]")) == 3
    # Not a DistributedError (an OSError on its way up): the record rides along all the same.
    assert failure_of(with_failure(OSError("reset"), culprit=1)).culprit == 1
    assert Failure(peer=2).suspect() == 2 and Failure(waiting_on=(5,)).suspect() == 5 and Failure().suspect() == -1
