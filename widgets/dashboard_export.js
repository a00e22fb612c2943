// The static export of many feature dashboards (ie_lab.export_dashboards): one offline HTML file that embeds this
// script, the style sheet and the features' data (JSON). A list of the features links to each one's section; each
// section is drawn by dashboard_view.js, as the notebook panel draws one feature. No network, no kernel.
import { drawFeature, fmt, h, pct } from "./dashboard_view.js";
import { plural } from "./util.js";

function main() {
  const src = document.getElementById("iel-dashboards");
  if (!src) return;
  const all = JSON.parse(src.textContent);
  const root = h("div", { class: "iel-root iel-dash iel-export" });
  const nav = h("nav", { class: "iel-dash-nav", "aria-label": "features" });
  nav.append(h("div", { class: "iel-colhead", text: `${plural(all.features.length, "feature")} at ${all.address}` }));
  const main = h("div", { class: "iel-dash-main" });
  for (const d of all.features) {
    nav.append(h("a", { href: `#feature-${d.feature}`, class: "iel-featbtn", "data-f": String(d.feature),
      title: `density ${pct(d.density)}, max ${fmt(d.max)}` }, `#${d.feature}`, h("span", { class: "iel-muted", text: ` ${pct(d.density)}` })));
    const sec = h("section", { id: `feature-${d.feature}`, class: "iel-dash-feature", "data-f": String(d.feature) });
    drawFeature(sec, d);
    main.append(sec);
  }
  root.append(h("h1", { class: "iel-dash-h1", text: all.title }), h("div", { class: "iel-muted", text: all.subtitle }), nav, main);
  document.body.append(root);
  document.body.dataset.ielReady = "true";
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", main); else main();
