"""The frame of every report page: one self-contained HTML file (inline CSS, inline SVG, one
inline script for the search box, the filters and sorting a table by a column), and writing it
so that no half-written page is left.

The page's Content-Security-Policy allows nothing from the network and only its own script (by
hash): even a name that escaped escaping could neither load nor run anything.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.tools.report.output import check_report_file
from mfsdp_ckpt.tools.report.svg import esc

__all__ = ["page", "write_page"]

_CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 18px; margin: 0 0 8px; } h2 { font-size: 15px; margin: 22px 0 6px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 4px 0 10px; } td, th { padding: 2px 8px; text-align: left;
  border-bottom: 1px solid #eee; vertical-align: top; } th { background: #f6f6f6; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .key { font-family: ui-monospace, monospace; font-size: 12px; word-break: break-all; }
svg text { font: 11px ui-monospace, monospace; fill: #222; }
.tensors { display: flex; flex-wrap: wrap; gap: 8px 16px; }
.tensor-card { width: 250px; } .tensor-card .key { display: block; margin-bottom: 2px; }
tr.differs td { background: #fde8e8; } .hidden { display: none !important; }
#search { width: 360px; padding: 4px 6px; margin: 6px 0; }
.note { color: #666; }
th[data-sort] { cursor: pointer; white-space: nowrap; } th[aria-sort=ascending]::after { content: " ▲"; }
th[aria-sort=descending]::after { content: " ▼"; } .pick { cursor: pointer; } tr.pick:hover td, td.pick:hover { outline: 1px solid #333; }
.filters label { margin-right: 14px; } .filters select { margin-left: 2px; }
table.matrix td, table.matrix th { padding: 2px 3px; min-width: 16px; } .scroll { overflow-x: auto; } .detail { margin-bottom: 2px; }
.side { display: flex; flex-wrap: wrap; gap: 0 32px; align-items: flex-start; }
.share { display: inline-block; height: 10px; background: #1f77b4; vertical-align: middle; }
details.raw-config { margin: 4px 0 10px; } details.raw-config summary { cursor: pointer; color: #1f5fa8; }
details.raw-config pre { max-height: 420px; overflow: auto; background: #f8f8f8; padding: 6px 8px; font-size: 12px; }
#by-kind td.diff { color: #8b1a1a; } #by-kind td.eq { color: #2a7a2a; }
#by-kind .sub { display: block; font-size: 11px; color: #777; white-space: nowrap; }
#by-kind th.part-group { text-align: center; border-bottom: 1px solid #ccc; }
#by-kind tr.all td { font-weight: 600; border-top: 2px solid #ccc; }
#by-kind td.counters { font-family: ui-monospace, monospace; font-size: 12px; white-space: nowrap; }
table.hists th { vertical-align: middle; min-width: 90px; } table.hists td { padding: 0 8px; } .block { display: block; }
#entries td.key { min-width: 240px; } table.lora th, .nowrap { white-space: nowrap; }
"""

_SCRIPT = """
(function () {
  var search = document.getElementById('search');
  var selects = Array.prototype.slice.call(document.querySelectorAll('select[data-filter]'));
  function apply() {
    var q = search.value.toLowerCase();
    var want = selects.filter(function (s) { return s.value; });
    var n = 0;
    document.querySelectorAll('[data-key]').forEach(function (el) {
      var hit = !q || el.getAttribute('data-key').toLowerCase().indexOf(q) >= 0;
      want.forEach(function (s) {
        if (el.getAttribute('data-' + s.getAttribute('data-filter')) !== s.value) { hit = false; }
      });
      el.classList.toggle('hidden', !hit);
      if (hit && el.tagName === 'TR') { n += 1; }
    });
    document.getElementById('matches').textContent = q || want.length ? n + ' matching rows' : '';
  }
  function pick(el) {
    selects.forEach(function (s) {
      var v = el.getAttribute('data-set-' + s.getAttribute('data-filter'));
      s.value = v === null ? '' : v;
    });
    apply();
    document.getElementById('entries').scrollIntoView();
  }
  function cell(row, col, num) {
    var c = row.cells[col];
    var v = c.hasAttribute('data-v') ? c.getAttribute('data-v') : c.textContent;
    if (!num) { return v.toLowerCase(); }
    v = parseFloat(v);
    return isNaN(v) ? -Infinity : v;
  }
  function sortBy(th) {
    var table = th.closest('table'), body = table.tBodies[0], col = th.cellIndex;
    var num = th.getAttribute('data-sort') === 'num', up = th.getAttribute('aria-sort') !== 'ascending';
    var rows = Array.prototype.slice.call(body.rows).map(function (r, i) { return [cell(r, col, num), i, r]; });
    rows.sort(function (a, b) {
      var d = a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0;
      return (up ? d : -d) || a[1] - b[1];
    });
    rows.forEach(function (r) { body.appendChild(r[2]); });
    table.querySelectorAll('th[data-sort]').forEach(function (h) { h.removeAttribute('aria-sort'); });
    th.setAttribute('aria-sort', up ? 'ascending' : 'descending');
  }
  search.addEventListener('input', apply);
  selects.forEach(function (s) { s.addEventListener('change', apply); });
  document.querySelectorAll('.pick').forEach(function (el) {
    el.addEventListener('click', function () { pick(el); });
  });
  document.querySelectorAll('th[data-sort]').forEach(function (th) {
    th.tabIndex = 0;
    th.addEventListener('click', function () { sortBy(th); });
    th.addEventListener('keydown', function (e) { if (e.key === 'Enter') { sortBy(th); } });
  });
})();
"""


def page(title: str, body: str) -> str:
    """The whole document: ``title`` (escaped here) and ``body`` (markup, already escaped)."""
    digest = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
    csp = f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{digest}'"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        '<input id="search" type="search" placeholder="filter tensors by name" autocomplete="off">'
        ' <span id="matches" class="note"></span>'
        f"{body}<script>{_SCRIPT}</script></body></html>\n"
    )


def write_page(text: str, out: str | os.PathLike) -> str:
    """Write ``text`` to ``out`` whole or not at all (a temporary file beside it, then a rename);
    an unwritable ``out``, or one that is not a regular file (a directory, a link, a FIFO), is a
    one-line :class:`CheckpointError` naming it."""
    out = os.fspath(out)
    directory = os.path.dirname(os.path.abspath(out))
    check_report_file(out)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise CheckpointError(f"{out}: cannot write the report: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return out
