"""`snakemake --report report.html` on the smoke run: every figure, table and training curve is in it, and
the page, rendered by headless Chromium, shows the Pareto figure when one opens it."""

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import snakemake

CHROMIUM = Path("/usr/bin/chromium")
PARETO = "results/expert/pareto.png"
# What a figure on screen may differ from its PNG by, as the mean absolute grey-level difference (0-1):
# resampling to the displayed size, nothing more. Measured on the smoke run: the Pareto and the gain and
# forgetting figures against themselves 0.006 and 0.004; the one on screen against the other 0.12 and 0.14,
# the Pareto figure against the latency figure 0.11.
SAME = 0.02
# Chromium on a closed network: no sandbox (root in CI), no GPU, nothing fetched, a profile of its own.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--force-device-scale-factor=1",
    "--window-size=1600,1000",
    "--virtual-time-budget=10000",
)
# Opens one result as a click on it would (the report is a single-page app with no address per result),
# once the app exists (React may create it after the load event), then records where its image lies, for
# the test to find it in the screenshot.
OPEN_RESULT = """<script>
window.addEventListener("load", () => {
  const path = %s;
  if (!(path in results)) return;
  let opened = false;
  const place = () => {
    if (!opened && typeof app !== "undefined") {
      app.setView({navbarMode: "resultinfo", content: "img", contentPath: results[path].data_uri, resultPath: path});
      opened = true;
    }
    const img = [...document.querySelectorAll("#app img")].find((i) => i.src === results[path].data_uri);
    if (img && img.complete && img.naturalWidth) {
      const r = img.getBoundingClientRect();
      document.body.dataset.rect = JSON.stringify([r.x, r.y, r.width, r.height]);
    }
    setTimeout(place, 100);
  };
  place();
});
</script>"""


def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing in CI: .ci/run installs Debian's chromium before the tests")
    pytest.skip(f"{CHROMIUM} is missing (Debian's chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def report(smoke) -> Path:
    proc = snakemake(smoke, "--report", "report.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return smoke / "report.html"


def embedded(html: str, name: str) -> dict:
    """One of the JSON objects the report embeds (`var results = {...};`)."""
    found = re.search(rf"^\s*var {name} = (\{{.*\}});\s*$", html, re.M)
    assert found, f"report.html embeds no {name}"
    return json.loads(found.group(1))


def render(report: Path, result: str, out: Path) -> tuple[Path, list[float] | None]:
    """A screenshot of `report` with `result` opened, and the rectangle (x, y, width, height) of its image."""
    out.mkdir(parents=True, exist_ok=True)
    page = out / "opened.html"
    # The page's own </body>, the last: the embedded libraries hold that string too.
    head, _, tail = report.read_text().rpartition("</body>")
    page.write_text(head + OPEN_RESULT % json.dumps(result) + "</body>" + tail)
    shot = out / "screenshot.png"
    cmd = [str(chromium()), *FLAGS, f"--user-data-dir={out / 'profile'}", f"--screenshot={shot}", "--dump-dom"]
    proc = subprocess.run([*cmd, page.as_uri()], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    rect = re.search(r'data-rect="([^"]+)"', proc.stdout)
    return shot, json.loads(rect.group(1).replace("&quot;", '"')) if rect else None


def best_offset(screen: np.ndarray, want: np.ndarray) -> tuple[int, int]:
    """The offset (x, y) of the window of `screen` closest to `want` in squared difference (grey levels),
    over every offset: |S - T|^2 = S^2 - 2 S.T + T^2 per window, the cross term by FFT."""
    (big_h, big_w), (h, w) = screen.shape, want.shape
    cross = np.fft.irfft2(np.fft.rfft2(screen) * np.fft.rfft2(want[::-1, ::-1], s=screen.shape), s=screen.shape)
    squares = np.pad(screen**2, ((1, 0), (1, 0))).cumsum(0).cumsum(1)
    window = squares[h:, w:] - squares[:-h, w:] - squares[h:, :-w] + squares[:-h, :-w]
    ssd = window - 2 * cross[h - 1 :, w - 1 :]
    y, x = np.unravel_index(np.argmin(ssd), ssd.shape)
    assert ssd.shape == (big_h - h + 1, big_w - w + 1)
    return int(x), int(y)


def difference(shot: Path, rect: list[float], figure: Path) -> float:
    """Mean absolute grey-level difference (0-1) between `figure`, resampled to the size the page gave it
    (`rect`), and the part of the screenshot where it matches best. Searched for, not read off `rect`: the
    screenshot lays the page out anew at the full window height, which moves it (headless Chromium's page
    is shorter than its window while the script runs)."""
    from PIL import Image

    screen = np.asarray(Image.open(shot).convert("L"), dtype=float) / 255
    w, h = round(rect[2]), round(rect[3])
    assert 200 < w <= screen.shape[1] and 200 < h <= screen.shape[0], f"figure shown at {rect}, not on screen"
    image = Image.open(figure).convert("L").resize((w, h), Image.Resampling.BOX)
    want = np.asarray(image, dtype=float) / 255
    x, y = best_offset(screen, want)
    return float(np.abs(screen[y : y + h, x : x + w] - want).mean())


@pytest.mark.workflow
def test_report_holds_every_figure_table_and_training_curve(report, smoke):
    html = report.read_text()
    results, categories = embedded(html, "results"), embedded(html, "categories")
    figures = {str(p.relative_to(smoke)) for p in (smoke / "results").rglob("*.png")}
    tables = {str(p.relative_to(smoke)) for p in (smoke / "results/tables").rglob("*.html")}
    assert figures - set(results) == set()  # every figure the workflow drew, training curves included
    assert tables and tables - set(results) == set()
    curves = {f for f in figures if f.endswith("/training.png")}
    # Every on-policy and SFT run of the expert setting (OPSD x3, GRPO, SDPO x3, SDPO-CoT; SFT of the post
    # model and of the donor), of every chain stage, and the pedagogical teacher's GRPO.
    assert len([c for c in curves if c.startswith("results/expert/")]) == 10
    assert {"results/expert/sft/post/lr~1e-3/training.png", "results/expert/sft/step~50/lr~1e-3/training.png"} <= curves
    assert any("/chain/sdpo/" in c for c in curves) and any("/chain/grpo/" in c for c in curves)
    assert any("/chain/sft/" in c for c in curves) and any("/chain/tune/" in c for c in curves)
    assert "results/pedagogical/pedagogical/training.png" in curves
    exps = [p.parent.name for p in (smoke / "results").glob("*/summary.parquet")]
    for exp in exps:
        assert f"results/tables/{exp}/summary.html" in results
    # The report reads per experiment: one category each, with its figures, tables and curves under it.
    assert set(exps) | {"study", "moe"} <= set(categories)
    assert {"Figures", "Tables", "Training curves"} <= set(categories["expert"])
    # Each result carries its caption, rendered (a Jinja error would have stopped the report).
    assert "Pareto frontier" in results[PARETO]["caption"]


@pytest.mark.workflow
def test_rendered_report_shows_the_pareto_figure(report, smoke, tmp_path):
    pareto = smoke / PARETO
    shot, rect = render(report, PARETO, tmp_path / "pareto")
    assert rect is not None, "the report did not show the Pareto figure"
    assert difference(shot, rect, pareto) < SAME
    # The check tells figures apart: another figure on screen is not the Pareto figure.
    other = "results/expert/gain_forgetting.png"
    shot, rect = render(report, other, tmp_path / "other")
    assert rect is not None and difference(shot, rect, pareto) > 2 * SAME
    assert difference(shot, rect, smoke / other) < SAME


@pytest.mark.workflow
def test_a_result_missing_from_the_report_shows_nothing(report, tmp_path):
    shot, rect = render(report, "results/expert/no-such-figure.png", tmp_path)
    assert rect is None and shot.exists()


def test_report_tables_show_every_row_escaped_and_rounded(tmp_path):
    import polars as pl

    from graftlab.analysis.report_tables import write_report_tables

    frame = pl.DataFrame({"method": ["sft", "<graft>"], "old": [0.123456789, None], "steps": [3, 40]})
    frame.write_parquet(tmp_path / "summary.parquet")
    out = tmp_path / "tables"
    [page] = write_report_tables([{"category": "x", "name": "summary", "path": tmp_path / "summary.parquet"}], out)
    assert page == out / "x" / "summary.html"
    rows = re.findall(r"<tr>(.*?)</tr>", page.read_text())
    cells = [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", r) for r in rows]
    assert cells == [["method", "old", "steps"], ["sft", "0.1235", "3"], ["&lt;graft&gt;", "", "40"]]


def test_report_tables_refuse_an_unreadable_table_and_write_nothing(tmp_path):
    from graftlab.analysis.report_tables import write_report_tables
    from graftlab.errors import GraftlabError

    tables = [{"category": "x", "name": "latency", "path": tmp_path / "gone.parquet"}]
    with pytest.raises(GraftlabError, match="report table .*gone.parquet: cannot read"):
        write_report_tables(tables, tmp_path / "tables")
    assert not (tmp_path / "tables").exists()
