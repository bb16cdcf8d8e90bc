// The server's web page (speculant.serve.page): a chat client of /v1/chat/completions.
//
// Every request carries the whole conversation; "New chat" clears it. Answers stream in and are rendered as
// markdown as they come (marked), sanitized (raw HTML in an answer is shown as text, and DOMPurify cleans the
// result), with highlighted code blocks (highlight.js). Each character keeps how its token came (an accepted draft
// token or the target's own, from the chunks' speculant.sources spans), coloured in the rendered text. Under each
// answer: its prompt tokens and how many of them the server reused from its prefix cache, its tokens, τ and speed.
// No inline script or handler: the page works under a Content-Security-Policy of default-src 'self'.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const messages = [];  // the conversation: {role, content}, sent whole with each request
  let model = null;
  let controller = null;  // the running request's AbortController
  let chat = 0;  // which conversation: "New chat" starts another, and a request of an old one leaves it alone

  // ------------------------------------------------------------------------------------------ markdown
  const ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  const highlighted = new Map();  // (language, code) -> highlighted HTML: a streamed answer re-renders often

  function highlight(code, lang) {
    const key = lang + "\u0000" + code;
    let html = highlighted.get(key);
    if (html === undefined) {
      const known = lang && window.hljs && hljs.getLanguage(lang);
      try {
        html = known ? hljs.highlight(code, {language: lang, ignoreIllegals: true}).value
          : window.hljs ? hljs.highlightAuto(code).value : escapeHtml(code);
      } catch (e) {
        html = escapeHtml(code);
      }
      if (highlighted.size > 200) highlighted.clear();
      highlighted.set(key, html);
    }
    return html;
  }

  const renderer = {
    // the model's raw HTML is text, never markup
    html(token) { return token.block ? "<p>" + escapeHtml(token.text) + "</p>" : escapeHtml(token.text); },
    // an image is a link: the page loads nothing an answer names
    image(token) {
      const href = token.href || "";
      return '<a href="' + escapeHtml(href) + '">' + escapeHtml(token.text || href) + "</a>";
    },
    code(token) {
      const lang = (token.lang || "").trim().split(/\s+/)[0].toLowerCase();
      const code = token.text.replace(/\n$/, "");
      const cls = "hljs" + (lang ? " language-" + escapeHtml(lang) : "");
      return '<pre><code class="' + cls + '">' + highlight(code, lang) + "</code></pre>\n";
    },
  };
  const md = window.marked ? new marked.Marked({gfm: true, breaks: false, async: false, renderer: renderer}) : null;
  if (window.DOMPurify) {
    DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A") {  // a link opens beside the conversation
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
    });
  }

  // markdown -> sanitized HTML (plain escaped text when the renderer files did not load)
  function toHtml(text) {
    if (!md || !window.DOMPurify) return "<p>" + escapeHtml(text).replace(/\n/g, "<br>") + "</p>";
    return DOMPurify.sanitize(md.parse(text), {FORBID_TAGS: ["style", "img", "form", "input"], FORBID_ATTR: ["style"]});
  }

  // Colour the rendered text by the source of each character of the markdown: a rendered character is matched to
  // the next equal character of the source within a short window (markdown syntax is skipped, text is kept).
  const WINDOW = 48;
  function colour(root, text, origins) {
    if (!origins.includes("draft")) return;
    const src = Array.from(text);
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const nodes = [];
    while (walker.nextNode()) nodes.push(walker.currentNode);
    let at = 0;
    for (const node of nodes) {
      const chars = Array.from(node.data);
      const draft = chars.map((c) => {
        const end = Math.min(src.length, at + WINDOW);
        let k = at;
        while (k < end && src[k] !== c) k++;
        if (k === end) return false;  // not in the source near here (a list number, a decoded entity)
        at = k + 1;
        return origins[k] === "draft";
      });
      if (!draft.includes(true)) continue;
      const frag = document.createDocumentFragment();
      for (let i = 0; i < chars.length;) {
        let j = i;
        while (j < chars.length && draft[j] === draft[i]) j++;
        const piece = chars.slice(i, j).join("");
        if (draft[i]) {
          const span = document.createElement("span");
          span.className = "draft";
          span.textContent = piece;
          frag.appendChild(span);
        } else {
          frag.appendChild(document.createTextNode(piece));
        }
        i = j;
      }
      node.replaceWith(frag);
    }
  }

  // Render markdown `text` into element `el`; `origins[i]`: "draft" or "target" for the i-th code point of text.
  function render(el, text, origins) {
    el.innerHTML = toHtml(text);
    if (origins) colour(el, text, origins);
    return el;
  }

  // --------------------------------------------------------------------------------------------- chat
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

  // run change(), then keep the log scrolled to its end if it was there (reading further up stays put)
  function follow(change) {
    const log = $("log");
    const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    change();
    if (atEnd) log.scrollTop = log.scrollHeight;
  }

  function busy(on) {
    $("send").disabled = on;
    $("stop").hidden = !on;
  }

  // the tools of the settings' JSON box (an array of OpenAI function tools), or null when it is empty
  function tools() {
    const text = $("tools").value.trim();
    if (!text) return null;
    const parsed = JSON.parse(text);
    return Array.isArray(parsed) ? parsed : [parsed];
  }

  // A tool call of the answer: its function's name and its arguments as indented JSON (as text, never HTML).
  function showCall(box, call) {
    const div = document.createElement("div");
    div.className = "tool-call";
    const name = document.createElement("div");
    name.className = "tool-name";
    name.textContent = "tool call: " + call.function.name;
    const args = document.createElement("pre");
    let shown = call.function.arguments;
    try { shown = JSON.stringify(JSON.parse(shown), null, 2); } catch (e) { /* not JSON yet: as sent */ }
    args.textContent = shown;
    div.append(name, args);
    box.appendChild(div);
  }

  async function send(text) {
    if (!model) await loadModel();
    let offered;
    try {
      offered = tools();
    } catch (e) {
      add("error", "tools: not valid JSON (" + e.message + ")");
      return;
    }
    const mine = chat;
    messages.push({role: "user", content: text});
    follow(() => add("user", text));
    const out = add("assistant", "");
    const callBox = add("tool-calls", "");
    const meta = add("meta", "");
    busy(true);
    controller = new AbortController();
    let steps = 0, tokens = 0, accepted = 0, first = null, answer = "", usage = null, stats = null, finish = "";
    const origins = [];
    const calls = [];  // the answer's tool calls, by index: {id, type, function: {name, arguments}}
    let pending = false;
    const paint = () => { pending = false; follow(() => render(out, answer, origins)); };
    const schedule = () => { if (!pending) { pending = true; requestAnimationFrame(paint); } };
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
      const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), signal: controller.signal,
        body: JSON.stringify(Object.assign({model: model, messages: messages, stream: true,
          stream_options: {include_usage: true}, speculant_sources: true,
          max_tokens: parseInt($("max").value, 10) || 256, temperature: parseFloat($("temp").value) || 0},
          offered ? {tools: offered} : {}))});
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
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const line = buffer.slice(0, cut).trim();
          buffer = buffer.slice(cut + 2);
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices && chunk.choices[0];
          const piece = choice && choice.delta && choice.delta.content;
          const sp = chunk.speculant;
          if (sp && sp.tokens !== undefined) {
            if (first === null) first = performance.now();
            steps += 1; tokens += sp.tokens; accepted += sp.accepted;
          }
          if (piece) {
            answer += piece;
            const n = Array.from(piece).length;  // code points, as the server counts them
            let at = 0;
            for (const [count, source] of (sp && sp.sources) || []) {
              for (let i = 0; i < count && at < n; i++, at++) origins.push(source);
            }
            for (; at < n; at++) origins.push("target");
            schedule();
          }
          for (const tc of (choice && choice.delta && choice.delta.tool_calls) || []) {
            const call = calls[tc.index] || (calls[tc.index] = {id: "", type: "function",
                                                                  function: {name: "", arguments: ""}});
            if (tc.id) call.id = tc.id;
            if (tc.function && tc.function.name) call.function.name += tc.function.name;
            if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
            follow(() => { callBox.textContent = ""; calls.forEach((c) => c && showCall(callBox, c)); });
          }
          if (choice && choice.finish_reason) finish = choice.finish_reason;
          if (sp && sp.acceptance_length !== undefined) {
            stats = sp;
            $("final").textContent = "response: τ " + sp.acceptance_length.toFixed(2) + ", " + sp.target_calls +
              " target calls, " + sp.method + ", " + finish;
          }
          show();
        }
      }
      messages.push(calls.length ? {role: "assistant", content: answer || null, tool_calls: calls.filter(Boolean)}
                                 : {role: "assistant", content: answer});
    } catch (e) {
      if (mine !== chat) return;  // "New chat" stopped it: the new conversation does not hold it
      if (e.name === "AbortError" && answer) {
        messages.push({role: "assistant", content: answer});  // the stopped answer stays in the conversation
        finish = "stopped";
      } else {
        add("error", e.name === "AbortError" ? "stopped" : "error: " + e.message);
        messages.pop();
      }
    } finally {
      controller = null;
      paint();
      follow(() => { meta.textContent = describe(usage, tokens, stats, first, finish); });
      busy(false);
    }
  }

  // "prompt N tokens, M reused · T tokens · τ x · s tokens/s": M from usage.prompt_tokens_details.cached_tokens
  function describe(usage, tokens, stats, first, finish) {
    const parts = [];
    if (usage) {
      const details = usage.prompt_tokens_details;
      const reused = details && details.cached_tokens !== undefined && details.cached_tokens !== null
        ? ", " + details.cached_tokens + " reused" : "";
      parts.push("prompt " + usage.prompt_tokens + " tokens" + reused);
    }
    parts.push((usage ? usage.completion_tokens : tokens) + " tokens");
    if (stats) parts.push("τ " + stats.acceptance_length.toFixed(2));
    if (first !== null && tokens) {
      const s = (performance.now() - first) / 1000;
      if (s > 0) parts.push((tokens / s).toFixed(1) + " tokens/s");
    }
    if (finish) parts.push(finish);
    return parts.join(" · ");
  }

  function newChat() {
    chat += 1;
    if (controller) controller.abort();
    messages.length = 0;
    $("log").textContent = "";
    for (const id of ["tau", "tps", "share"]) $(id).textContent = "-";
    $("ntok").textContent = "0";
    $("final").textContent = "";
    $("prompt").focus();
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
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("new").addEventListener("click", newChat);
  $("drafts").addEventListener("change", () => $("log").classList.toggle("drafts", $("drafts").checked));
  $("log").classList.toggle("drafts", $("drafts").checked);

  // for tests and the curious: the renderer and the conversation
  window.speculantPage = {
    render: (text, origins) => render(document.createElement("div"), text, origins).innerHTML,
    messages: messages,
  };
  loadModel();
})();
