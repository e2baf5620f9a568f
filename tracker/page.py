"""The swarm page: one live HTML page of what the tracker knows, and the JSON it polls.

Owns `swarm_view(status)` (the tracker's status regrouped for people: members
by region with their version and lag behind the latest) and the page itself,
one document with inline CSS and JS and no external asset: the current view is
embedded in the page, drawn at once, then refreshed from /swarm.json every
POLL_SECONDS. Must not reach members: it shows only what the tracker holds.

What the tracker does not hold: bytes by source and chunk rejections are
counted by each member and exported on its own /metrics. They cannot ride on
the Heartbeat: the wire refuses a message with a field it does not know
(protocol/wire.py: decode_body), so a new field would break every older
tracker. The page says so where they would be, and shows the rejections the
tracker itself counts (announcements refused).
"""

from __future__ import annotations

import html
import json
import time

POLL_SECONDS = 2.0
MEMBER_NOTE = ("Bytes by source (origin, same region, other regions) and chunk rejections by reason are counted "
               "by each member: see its /metrics (patchswarm_bytes_total, patchswarm_chunks_rejected_total). "
               "The tracker does not receive them.")


def swarm_view(st: dict) -> dict:
    """The tracker's status as the page shows it: members by region (origin's first), each with version and lag."""
    latest = st.get("latest_version")
    regions: dict[str, list[dict]] = {}
    for m in st.get("members", []):
        held = max(m["versions"], default=None)
        lag = None if latest is None or held is None else max(0, latest - held)
        regions.setdefault(m["region"], []).append({"id": m["id"], "role": m["role"], "addr": m["addr"],
                                                    "version": held, "lag": lag})
    origin_regions = {m["region"] for m in st.get("members", []) if m["role"] == "origin"}
    ordered = sorted(regions, key=lambda r: (r not in origin_regions, r))
    return {
        "swarm_id": st.get("swarm_id"),
        "latest_version": latest,
        "members": sum(len(v) for v in regions.values()),
        "nodes_current": sum(1 for v in regions.values() for m in v if m["role"] == "node" and m["lag"] == 0),
        "nodes": sum(1 for v in regions.values() for m in v if m["role"] == "node"),
        "regions": [{"region": r, "members": sorted(regions[r], key=lambda m: (m["role"] != "origin", m["id"]))}
                    for r in ordered],
        "tracker_rejections": {"manifests": st.get("manifests_rejected", 0)},
        "member_counters_note": MEMBER_NOTE,
        "generated_at": time.time(),
    }


def page_html(view: dict) -> str:
    """The page, with `view` embedded so it shows the swarm before its first poll."""
    data = json.dumps(view).replace("<", "\\u003c")  # nothing inside can close the script element
    title = html.escape(f"patchswarm · swarm {view.get('swarm_id') or ''}")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", data).replace(
        "__POLL_MS__", str(int(POLL_SECONDS * 1000)))


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
 body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em;color:#1d2329;background:#fbfbfc}
 h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.2em 0 .3em}
 .sum{color:#4a5560;margin-bottom:1em} .sum b{color:#1d2329}
 table{border-collapse:collapse;min-width:34em;background:#fff;box-shadow:0 0 0 1px #dde1e5}
 th,td{padding:.3em .8em;text-align:left;border-bottom:1px solid #eceff2} th{background:#f2f4f6;font-weight:600}
 td.num{text-align:right;font-variant-numeric:tabular-nums}
 .lag0{color:#17803d} .lag1{color:#a76b00} .lagn{color:#b42318;font-weight:600}
 .origin{font-weight:600} .note{color:#4a5560;max-width:48em} .stale{color:#b42318}
</style></head>
<body>
<h1 id="title"></h1>
<div class="sum" id="summary"></div>
<div id="regions"></div>
<h2>Bytes by source and rejections</h2>
<p>Announcements refused by the tracker: <b id="rej-manifests"></b></p>
<p class="note" id="note"></p>
<p class="note" id="updated"></p>
<script id="initial" type="application/json">__DATA__</script>
<script>
"use strict";
function el(tag, attrs, text){const e=document.createElement(tag);for(const k in attrs||{})e.setAttribute(k,attrs[k]);
  if(text!==undefined&&text!==null)e.textContent=String(text);return e;}
function lagClass(l){return l===null?"":l===0?"lag0":l===1?"lag1":"lagn";}
function draw(v){
  document.getElementById("title").textContent="patchswarm swarm "+(v.swarm_id||"");
  const s=document.getElementById("summary");s.textContent="";
  s.append("latest version ",el("b",{},v.latest_version===null?"none":v.latest_version),
    " · members ",el("b",{},v.members)," · nodes at the latest ",el("b",{},v.nodes_current+" of "+v.nodes));
  const root=document.getElementById("regions");root.textContent="";
  for(const r of v.regions){
    root.append(el("h2",{},"region "+r.region+" ("+r.members.length+")"));
    const t=el("table");const h=el("tr");
    for(const c of ["member","role","version","behind","address"])h.append(el("th",{},c));t.append(h);
    for(const m of r.members){const tr=el("tr",{"class":m.role==="origin"?"origin":""});
      tr.append(el("td",{},m.id),el("td",{},m.role),el("td",{"class":"num"},m.version===null?"-":m.version),
        el("td",{"class":"num "+lagClass(m.lag)},m.lag===null?"-":m.lag),el("td",{},m.addr));t.append(tr);}
    root.append(t);}
  document.getElementById("rej-manifests").textContent=v.tracker_rejections.manifests;
  document.getElementById("note").textContent=v.member_counters_note;
  asOf="as of "+new Date(v.generated_at*1000).toISOString();
  const u=document.getElementById("updated");u.textContent=asOf;u.className="note";
}
let asOf="";
draw(JSON.parse(document.getElementById("initial").textContent));
async function poll(){
  try{const r=await fetch("swarm.json",{cache:"no-store"});if(r.ok)draw(await r.json());
      else throw new Error(r.status);}
  catch(e){const u=document.getElementById("updated");u.className="note stale";
      u.textContent="tracker not answering ("+e+"); showing the swarm "+asOf;}
  setTimeout(poll,__POLL_MS__);}
setTimeout(poll,__POLL_MS__);
</script></body></html>
"""
