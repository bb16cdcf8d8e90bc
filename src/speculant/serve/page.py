"""The server's web page (``GET /``): a chat playground in one HTML document, no external assets, no build step.

It lists the served model (``GET /v1/models``), sends the conversation to ``/v1/chat/completions`` with
``stream: true`` and ``speculant_sources: true``, and renders the answer as it streams: each character coloured by
how its token came, an accepted draft token (green) or the target's own (the bonus token of a step, or plain
decoding), from each chunk's ``speculant.sources`` spans; below it, live τ (tokens per target forward), tokens per
second and the share of accepted draft tokens, then the final statistics of the response. An API key field is there
for servers started with ``--api-key``.
"""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>speculant</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1c1e21; }
  header { background: #20232a; color: #fff; padding: 10px 18px; display: flex; gap: 16px; align-items: baseline; }
  header h1 { font-size: 18px; margin: 0; }
  header span { opacity: .8; font-size: 14px; }
  main { max-width: 920px; margin: 0 auto; padding: 14px; }
  #log { background: #fff; border: 1px solid #dde; border-radius: 8px; padding: 12px; min-height: 280px;
         white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.45; }
  .user { color: #555; border-left: 3px solid #88a; padding-left: 8px; margin: 8px 0; }
  .assistant { margin: 8px 0 16px 0; }
  .draft { background: #c8f2cf; }
  .target { background: transparent; }
  .error { color: #b00020; }
  form { display: flex; gap: 8px; margin-top: 10px; }
  textarea { flex: 1; font: inherit; padding: 8px; border-radius: 6px; border: 1px solid #bbc; min-height: 56px; }
  button { padding: 0 18px; border-radius: 6px; border: 0; background: #2f6fed; color: #fff; font-size: 15px; }
  button:disabled { background: #99a; }
  #stats { margin-top: 8px; font-size: 13px; color: #333; display: flex; gap: 18px; flex-wrap: wrap; }
  #stats b { font-variant-numeric: tabular-nums; }
  .legend { font-size: 13px; margin-top: 6px; color: #444; }
  details { margin-top: 10px; font-size: 13px; }
  input { font: inherit; padding: 3px 6px; }
</style>
</head>
<body>
<header><h1>speculant</h1><span id="model">loading the model list...</span></header>
<main>
  <div id="log" aria-live="polite"></div>
  <div class="legend"><span class="draft">accepted draft token</span> &nbsp; <span>the target's own token</span></div>
  <div id="stats">
    <span>τ <b id="tau">-</b></span><span>tokens/s <b id="tps">-</b></span>
    <span>accepted drafts <b id="share">-</b></span><span>tokens <b id="ntok">0</b></span>
    <span id="final"></span>
  </div>
  <form id="form">
    <textarea id="prompt" placeholder="Ask something (Enter sends, Shift+Enter for a new line)"></textarea>
    <button id="send" type="submit">Send</button>
  </form>
  <details><summary>settings</summary>
    <p>max tokens <input id="max" type="number" value="256" min="1"> &nbsp;
       temperature <input id="temp" type="number" value="0" min="0" step="0.1"> &nbsp;
       API key <input id="key" type="password" placeholder="if the server has one"></p>
    <p><button id="clear" type="button">New conversation</button></p>
  </details>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const messages = [];
let model = null;

function headers() {
  const h = {"Content-Type": "application/json"};
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    model = body.data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = "model list unavailable: " + e.message;
  }
}

function add(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  if (text) div.textContent = text;
  $("log").appendChild(div);
  return div;
}

function paint(div, text, sources) {
  const chars = Array.from(text);  // code points, as the server counts them
  if (!sources) { div.appendChild(document.createTextNode(text)); return; }
  let at = 0;
  for (const [n, source] of sources) {
    const span = document.createElement("span");
    span.className = source;
    span.textContent = chars.slice(at, at + n).join("");
    div.appendChild(span);
    at += n;
  }
  if (at < chars.length) div.appendChild(document.createTextNode(chars.slice(at).join("")));
}

async function send(text) {
  if (!model) await loadModel();
  messages.push({role: "user", content: text});
  add("user", text);
  const out = add("assistant", "");
  $("send").disabled = true;
  let steps = 0, tokens = 0, accepted = 0, first = null, answer = "";
  const show = () => {
    $("tau").textContent = steps ? (tokens / steps).toFixed(2) : "-";
    $("share").textContent = tokens ? Math.round(100 * accepted / tokens) + "%" : "-";
    $("ntok").textContent = tokens;
    if (first !== null) {
      const s = (performance.now() - first) / 1000;
      $("tps").textContent = s > 0 ? (tokens / s).toFixed(1) : "-";
    }
  };
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify({
      model: model, messages: messages, stream: true, speculant_sources: true,
      max_tokens: parseInt($("max").value, 10) || 256, temperature: parseFloat($("temp").value) || 0})});
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices && chunk.choices[0];
        const piece = choice && choice.delta && choice.delta.content;
        const sp = chunk.speculant;
        if (sp && sp.tokens !== undefined) {
          if (first === null) first = performance.now();
          steps += 1; tokens += sp.tokens; accepted += sp.accepted;
        }
        if (piece) { answer += piece; paint(out, piece, sp && sp.sources); }
        if (sp && sp.acceptance_length !== undefined) {
          $("final").textContent = "response: τ " + sp.acceptance_length.toFixed(2) + ", " + sp.target_calls +
            " target calls, " + sp.method + ", " + (choice ? choice.finish_reason : "");
        }
        show();
      }
    }
    messages.push({role: "assistant", content: answer});
  } catch (e) {
    add("error", "error: " + e.message);
    messages.pop();
  } finally {
    $("send").disabled = false;
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
$("clear").addEventListener("click", () => { messages.length = 0; $("log").textContent = ""; });
loadModel();
</script>
</body>
</html>
"""
