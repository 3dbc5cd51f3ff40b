// One assistant reply on screen: its markdown with each token coloured by source, a cursor while it
// streams, its figures (TTFT, tokens/s, tokens per step, draft tau, lookup share), and a note or error.
// A reply is data ({content, tok: {len, src, step}, stats, state, error}); its node is kept aside.
'use strict';
(function (B) {
  const { el, fmt, pct, WORD } = B;
  // Not stored with the reply: its DOM node, its tokens' start offsets, and the reply a node shows.
  const views = new WeakMap(), starts = new WeakMap(), shown = new WeakMap();

  function node(msg) {
    const view = el('div', 'msg assistant');
    view.append(el('div', 'body'), el('div', 'figures'));
    views.set(msg, view);
    shown.set(view, msg);
    return view;
  }

  function marks(msg) { // the markdown renderer's view of the tokens (offsets extended as tokens arrive)
    if (!msg.tok) return null;
    let offsets = starts.get(msg);
    if (!offsets || offsets.length > msg.tok.len.length) offsets = [];
    let at = offsets.length ? offsets[offsets.length - 1] + msg.tok.len[offsets.length - 1] : 0;
    for (let k = offsets.length; k < msg.tok.len.length; k++) { offsets.push(at); at += msg.tok.len[k]; }
    starts.set(msg, offsets);
    return { starts: offsets, src: msg.tok.src, step: msg.tok.step };
  }

  // Draw the reply again; `retry` (a function) adds a Retry button under an error.
  function paint(msg, retry) {
    const view = views.get(msg);
    if (!view) return;
    const body = view.querySelector('.body');
    B.markdown.render(body, msg.content, marks(msg));
    if (msg.state === 'streaming') {
      const last = body.lastElementChild;
      const host = last && /^(P|H\d|LI|UL|OL|BLOCKQUOTE)$/.test(last.tagName) ? deepest(last) : body;
      host.append(el('span', 'cursor'));
    }
    view.querySelector('.figures').replaceChildren(...figures(msg));
    view.querySelectorAll('.note, .error, .retry').forEach((n) => n.remove());
    if (msg.state === 'stopped') view.append(el('div', 'note', 'Stopped.'));
    if (msg.error) {
      view.append(el('div', 'error', msg.error));
      if (retry) {
        const button = el('button', 'quiet retry', 'Retry');
        button.type = 'button';
        button.addEventListener('click', retry);
        view.append(button);
      }
    }
  }

  function deepest(node) {
    while (node.lastElementChild && /^(UL|OL|LI|BLOCKQUOTE|P)$/.test(node.lastElementChild.tagName)) {
      node = node.lastElementChild;
    }
    return node;
  }

  function figures(msg) {
    const out = [];
    const s = msg.stats || {};
    const add = (label, value, title) => {
      const span = el('span');
      span.append(document.createTextNode(label + ' '), el('b', '', value));
      if (title) span.title = title;
      out.push(span);
    };
    const tok = msg.tok;
    const n = tok ? tok.len.length : s.tokens || 0;
    if (!n) return out;
    if (Number.isFinite(s.ttft)) add('TTFT', fmt(s.ttft, 2) + ' s', 'time to first token, from sending');
    if (n > 1 && s.last > s.first) {
      add('', fmt((n - 1) / ((s.last - s.first) / 1000), 1) + ' tok/s', 'tokens after the first per second');
    }
    if (tok) {
      const steps = new Set(), counts = { d: 0, l: 0, t: 0 };
      let decoded = 0;
      for (let k = 0; k < n; k++) {
        counts[tok.src[k]] = (counts[tok.src[k]] || 0) + 1;
        if (tok.step[k] > 0) { steps.add(tok.step[k]); decoded++; }
      }
      if (steps.size) add('', fmt(decoded / steps.size, 2) + ' tok/step', 'tokens per decode step');
      if (Number.isFinite(s.tau)) {
        add('draft tau', fmt(s.tau, 2), 'mean tokens per DFlash verify step, bonus included');
      }
      add('lookup', pct(counts.l / n), 'share of tokens copied from the context (prompt lookup)');
      const bar = el('span', 'share');
      bar.title = `draft ${pct(counts.d / n)} · lookup ${pct(counts.l / n)} · target ${pct(counts.t / n)}`;
      for (const key of ['d', 'l', 't']) {
        const seg = el('span', 's-' + WORD[key]);
        seg.style.width = (100 * counts[key] / n).toFixed(2) + '%';
        bar.append(seg);
      }
      out.push(bar);
    }
    add('', n + ' tokens');
    return out;
  }

  // ---- hover: a token's step and source; the step's tokens outlined ---------------------------------------
  function showTooltip(span) {
    const view = span.closest('.msg');
    const msg = shown.get(view);
    if (!msg || !msg.tok || document.body.classList.contains('hide-sources')) return;
    const k = Number(span.dataset.t), step = msg.tok.step[k];
    const counts = { d: 0, l: 0, t: 0 };
    msg.tok.step.forEach((s, i) => { if (s === step) counts[msg.tok.src[i]]++; });
    const total = counts.d + counts.l + counts.t;
    const tip = B.$('tooltip');
    tip.replaceChildren(el('b', '', step === 0 ? 'first token (prefill)' : 'step ' + step),
      document.createTextNode(' · ' + B.SOURCE_NAMES[WORD[msg.tok.src[k]]]), el('br'));
    const parts = ['d', 'l', 't'].filter((c) => counts[c]).map((c) => counts[c] + ' ' + WORD[c]);
    tip.append(document.createTextNode(`this step committed ${total} token${total === 1 ? '' : 's'}: ` +
      parts.join(' + ')));
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    const width = tip.offsetWidth, height = tip.offsetHeight;
    tip.style.left = Math.max(6, Math.min(window.innerWidth - width - 6, box.left)) + 'px';
    tip.style.top = (box.top - height - 6 < 4 ? box.bottom + 6 : box.top - height - 6) + 'px';
    view.querySelectorAll('.tok[data-s="' + step + '"]').forEach((t) => t.classList.add('step-hl'));
  }

  function hideTooltip() {
    B.$('tooltip').hidden = true;
    document.querySelectorAll('.step-hl').forEach((t) => t.classList.remove('step-hl'));
  }

  // ---- copy: without the clipboard API too (plain http from another machine is no secure context) --------
  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try { await navigator.clipboard.writeText(text); return true; } catch (err) { /* fall back */ }
    }
    const area = el('textarea', 'offscreen');
    area.value = text;
    area.setAttribute('readonly', '');
    document.body.append(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand('copy'); } catch (err) { ok = false; }
    area.remove();
    return ok;
  }

  async function copyCode(button) {
    const code = button.closest('.codeblock').querySelector('pre code');
    const ok = await copyText(code.textContent);
    if (!ok) { // leave the code selected, for Ctrl+C
      const range = document.createRange();
      range.selectNodeContents(code);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
    }
    button.textContent = ok ? 'Copied' : 'Press Ctrl+C';
    setTimeout(() => { button.textContent = 'Copy'; }, 1600);
  }

  // Hover and copy for every reply inside `log`.
  function attach(log) {
    log.addEventListener('click', (e) => {
      const button = e.target.closest('.copy');
      if (button) copyCode(button);
    });
    log.addEventListener('mouseover', (e) => {
      const span = e.target.closest('.tok');
      if (span) { hideTooltip(); showTooltip(span); }
    });
    log.addEventListener('mouseout', (e) => { if (e.target.closest('.tok')) hideTooltip(); });
    log.addEventListener('scroll', hideTooltip, { passive: true });
  }

  B.reply = { node, paint, attach };
})(window.Blockspec);
