// Small wrappers over uPlot (vendor/uplot, loaded before this module as the global
// `uPlot`). Series colours follow the Okabe-Ito palette and each series also has its
// own dash pattern, so lines stay apart without colour.

import { price } from "./dom.js";

export const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#666666"];
const DASHES = [null, [8, 4], [2, 3], [10, 3, 2, 3], [4, 4], [1, 5], [12, 6], [6, 2, 2, 2]];

function css(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
}

function axis(extra) {
  const ink = css("--muted");
  const line = css("--line");
  return { stroke: ink, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 }, ...extra };
}

export function style(i) {
  const colour = PALETTE[i % PALETTE.length];
  const dash = DASHES[i % DASHES.length];
  return dash ? { stroke: colour, dash } : { stroke: colour };
}

const priceFmt = (u, v) => price(v);

// A time chart in `el`: `series` is a list of {label, scale?, step?, points?, ...}.
// Returns {set(data), destroy()}; `data` is [times, ...values] as uPlot takes it.
// `x`: the x series and axis when x is not time ({series, axis}; `scales.x` too).
export function timeChart(el, series, { scales = {}, axes = [], height = 220, x = {} } = {}) {
  const opts = {
    width: Math.max(240, el.clientWidth),
    height,
    scales: { x: { time: true }, ...scales },
    legend: { live: true },
    cursor: { drag: { x: false, y: false } },
    axes: [axis(x.axis || {}), ...axes.map((a) => axis(a))],
    series: [
      x.series || {},
      ...series.map((s, i) => {
        const out = { width: 2, ...style(i), ...s };
        if (s.step) {
          out.paths = uPlot.paths.stepped({ align: 1 });
          out.points = { show: false };
        }
        if (s.points) {
          out.paths = () => null;
          out.points = { show: true, size: 7, width: 2, fill: s.hollow ? css("--panel") : out.stroke };
        }
        delete out.step;
        delete out.hollow;
        return out;
      }),
    ],
  };
  const empty = [[], ...series.map(() => [])];
  const plot = new uPlot(opts, empty, el);
  const ro = new ResizeObserver(() => plot.setSize({ width: Math.max(240, el.clientWidth), height }));
  ro.observe(el);
  return {
    set(data) {
      plot.setData(data);
    },
    destroy() {
      ro.disconnect();
      plot.destroy();
    },
  };
}

export const priceAxis = { scale: "price", side: 1, values: (u, vals) => vals.map((v) => priceFmt(u, v)), size: 70 };
export const priceValue = priceFmt;

// Dollars on an axis: micro-dollars below a tenth of a cent.
export function dollars(v) {
  if (v === null || v === undefined) return "—";
  if (v === 0) return "$0";
  if (Math.abs(v) < 0.001) return `${Number((v * 1e6).toPrecision(3))} µ$`;
  return "$" + Number(v.toPrecision(3));
}
