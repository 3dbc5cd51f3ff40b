// Markdown for model replies, rendered safely: the text is untrusted, so this never parses HTML. It builds
// DOM nodes with createElement and text nodes only (raw HTML in a reply shows as text), allows links to
// http(s) and mailto only, and loads no images. Every character of text it shows comes from one place,
// emitText, which knows the character's offset in the reply: that is how tokens keep their source colours
// through the markdown (an offset maps to the token that produced it).
// Supported: paragraphs (a newline is a line break), # headings, fenced code (with a copy button; an
// unclosed fence runs to the end, as while streaming), > quotes, - * + and 1. lists (nested), pipe
// tables, --- rules; inline `code`, **bold**, *em*, ~~strike~~, [links](url), bare http(s) links.
'use strict';
(function () {
  const el = window.Blockspec.el;
  const PUNCT = /[!-/:-@[-`{-~]/;
  const LIST_ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])( +|$)/;
  const FENCE = /^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+|$)/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?/;
  const TABLE_SEP = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  // ---- text with token marks -----------------------------------------------------------------------
  // marks: {starts: [offset of each token's first character], src: "dlt..." (one letter per token),
  //         step: [step per token]} or null (no colouring).
  const SOURCE = { d: 'draft', l: 'lookup', t: 'target' };

  function tokenAt(starts, offset) { // the last token starting at or before offset
    let lo = 0, hi = starts.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (starts[mid] <= offset) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  function emitText(ctx, parent, a, b) {
    if (a >= b) return;
    const marks = ctx.marks;
    if (!marks || !marks.starts.length) {
      parent.append(document.createTextNode(ctx.src.slice(a, b)));
      return;
    }
    let k = tokenAt(marks.starts, a);
    for (let at = a; at < b; k++) {
      const end = Math.min(b, k + 1 < marks.starts.length ? marks.starts[k + 1] : b);
      if (end > at) {
        const span = el('span', 'tok src-' + (SOURCE[marks.src[k]] || 'target'));
        span.dataset.t = String(k);
        span.dataset.s = String(marks.step[k]);
        span.textContent = ctx.src.slice(at, end);
        parent.append(span);
        at = end;
      }
    }
  }

  // ---- inline ------------------------------------------------------------------------------------------
  function runLength(s, i, ch, limit) {
    let n = 0;
    while (i + n < limit && s[i + n] === ch) n++;
    return n;
  }

  function findClosing(s, from, b, delim) { // a closing delimiter run not preceded by a space
    for (let j = s.indexOf(delim, from); j !== -1 && j + delim.length <= b; j = s.indexOf(delim, j + 1)) {
      if (j > from && !/\s/.test(s[j - 1]) && s[j - 1] !== '\\') return j;
    }
    return -1;
  }

  function inline(ctx, parent, a, b) {
    const s = ctx.src;
    let i = a, text = a;
    const flush = (end) => { emitText(ctx, parent, text, end); };
    while (i < b) {
      const c = s[i];
      if (c === '\\' && i + 1 < b && PUNCT.test(s[i + 1])) {
        flush(i); text = i + 1; i += 2; continue;
      }
      if (c === '`') {
        const n = runLength(s, i, '`', b);
        let j = i + n, close = -1;
        while ((j = s.indexOf('`'.repeat(n), j)) !== -1 && j + n <= b) {
          if (runLength(s, j, '`', b) === n) { close = j; break; }
          j += runLength(s, j, '`', b);
        }
        if (close === -1) { i += n; continue; }
        flush(i);
        let x = i + n, y = close;
        if (y - x >= 2 && s[x] === ' ' && s[y - 1] === ' ') { x++; y--; }
        const code = el('code');
        emitText(ctx, code, x, y);
        parent.append(code);
        i = text = close + n;
        continue;
      }
      if (c === '*' || c === '_' || c === '~') {
        const n = Math.min(runLength(s, i, c, b), 3);
        const wordInside = c === '_' && i > a && /[\p{L}\p{N}]/u.test(s[i - 1]);
        if ((c === '~' && n !== 2) || wordInside || i + n >= b || /\s/.test(s[i + n])) {
          i += runLength(s, i, c, b); continue;
        }
        const delim = c.repeat(n);
        const close = findClosing(s, i + n, b, delim);
        if (close === -1) { i += n; continue; }
        flush(i);
        let node;
        if (c === '~') node = el('del');
        else if (n === 1) node = el('em');
        else node = el('strong');
        let inner = node;
        if (n === 3) { inner = el('em'); node.append(inner); }
        inline(ctx, inner, i + n, close);
        parent.append(node);
        i = text = close + n;
        continue;
      }
      if (c === '[' || (c === '!' && s[i + 1] === '[')) {
        const image = c === '!';
        const link = parseLink(s, image ? i + 1 : i, b);
        if (link && SAFE_URL.test(link.url)) {
          flush(i);
          const anchor = el('a');
          anchor.href = link.url;
          anchor.rel = 'noopener noreferrer nofollow';
          anchor.target = '_blank';
          if (image) anchor.append(document.createTextNode('image: '));
          inline(ctx, anchor, link.textStart, link.textEnd);
          parent.append(anchor);
          i = text = link.end;
          continue;
        }
        i += image ? 2 : 1;
        continue;
      }
      if ((c === 'h' || c === 'H') && (i === a || /[\s(<]/.test(s[i - 1]))) {
        const m = /^https?:\/\/[^\s<>"'`]+/i.exec(s.slice(i, b));
        if (m) {
          let url = m[0];
          while (/[.,;:!?)\]'*_]$/.test(url)) url = url.slice(0, -1);
          if (url.length > 8) {
            flush(i);
            const anchor = el('a');
            anchor.href = url;
            anchor.rel = 'noopener noreferrer nofollow';
            anchor.target = '_blank';
            emitText(ctx, anchor, i, i + url.length);
            parent.append(anchor);
            i = text = i + url.length;
            continue;
          }
        }
      }
      i++;
    }
    flush(b);
  }

  function parseLink(s, i, b) { // [text](url) starting at i ('['); null if it is not one
    let depth = 0, j = i;
    for (; j < b; j++) {
      if (s[j] === '\\') { j++; continue; }
      if (s[j] === '[') depth++;
      else if (s[j] === ']' && --depth === 0) break;
    }
    if (j >= b || s[j + 1] !== '(') return null;
    const close = s.indexOf(')', j + 2);
    if (close === -1 || close >= b) return null;
    const url = s.slice(j + 2, close).trim().split(/\s+/)[0] || '';
    return { textStart: i + 1, textEnd: j, url, end: close + 1 };
  }

  // ---- blocks (a "line" is {a, b}: an offset range of the reply, without its newline) ------------------
  function lineText(ctx, line) { return ctx.src.slice(line.a, line.b); }
  function blank(ctx, line) { return /^\s*$/.test(lineText(ctx, line)); }
  function indentOf(text) { return /^ */.exec(text)[0].length; }
  function startsBlock(ctx, line) {
    const t = lineText(ctx, line);
    return FENCE.test(t) || HEADING.test(t) || RULE.test(t) || QUOTE.test(t) || LIST_ITEM.test(t);
  }

  function blocks(ctx, parent, lines) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i], t = lineText(ctx, line);
      let m;
      if (blank(ctx, line)) { i++; continue; }
      if ((m = FENCE.exec(t))) { i = fence(ctx, parent, lines, i, m); continue; }
      if ((m = HEADING.exec(t))) {
        const h = el('h' + m[1].length);
        let end = line.b;
        const closing = /[ \t]+#+[ \t]*$/.exec(t);
        if (closing) end = line.a + closing.index;
        inline(ctx, h, line.a + m[0].length, end);
        parent.append(h);
        i++; continue;
      }
      if (RULE.test(t)) { parent.append(el('hr')); i++; continue; }
      if (QUOTE.test(t)) {
        const inner = [];
        while (i < lines.length && QUOTE.test(lineText(ctx, lines[i]))) {
          const q = QUOTE.exec(lineText(ctx, lines[i]));
          inner.push({ a: lines[i].a + q[0].length, b: lines[i].b });
          i++;
        }
        const quote = el('blockquote');
        blocks(ctx, quote, inner);
        parent.append(quote);
        continue;
      }
      if ((m = LIST_ITEM.exec(t))) { i = list(ctx, parent, lines, i); continue; }
      if (i + 1 < lines.length && t.includes('|') && TABLE_SEP.test(lineText(ctx, lines[i + 1]))
          && lineText(ctx, lines[i + 1]).includes('-')) {
        i = table(ctx, parent, lines, i); continue;
      }
      i = paragraph(ctx, parent, lines, i);
    }
  }

  function paragraph(ctx, parent, lines, i) {
    const p = el('p');
    let first = true;
    while (i < lines.length && !blank(ctx, lines[i]) && (first || !startsBlock(ctx, lines[i]))) {
      const t = lineText(ctx, lines[i]);
      if (!first) p.append(el('br'));
      const lead = /^\s*/.exec(t)[0].length;
      inline(ctx, p, lines[i].a + lead, lines[i].a + t.trimEnd().length);
      first = false;
      i++;
    }
    parent.append(p);
    return i;
  }

  function fence(ctx, parent, lines, i, m) {
    const indent = m[1].length, marker = m[2], lang = m[3];
    const body = [];
    let j = i + 1;
    for (; j < lines.length; j++) {
      const t = lineText(ctx, lines[j]);
      const close = /^ {0,3}(`{3,}|~{3,})\s*$/.exec(t);
      if (close && close[1][0] === marker[0] && close[1].length >= marker.length) break;
      const strip = Math.min(indent, indentOf(t));
      body.push({ a: lines[j].a + strip, b: lines[j].b });
    }
    const box = el('div', 'codeblock');
    const head = el('div', 'codehead');
    const label = el('span');
    label.textContent = lang || 'code';
    const copy = el('button', 'copy');
    copy.type = 'button';
    copy.textContent = 'Copy';
    copy.setAttribute('aria-label', 'Copy code');
    head.append(label, copy);
    const pre = el('pre');
    const code = el('code');
    body.forEach((line, k) => {
      if (k) code.append(document.createTextNode('\n'));
      emitText(ctx, code, line.a, line.b);
    });
    pre.append(code);
    box.append(head, pre);
    parent.append(box);
    return j < lines.length ? j + 1 : j;
  }

  function list(ctx, parent, lines, i) {
    const first = LIST_ITEM.exec(lineText(ctx, lines[i]));
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? 'ol' : 'ul');
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    const baseIndent = first[1].length;
    while (i < lines.length) {
      const m = LIST_ITEM.exec(lineText(ctx, lines[i]));
      if (!m || m[1].length !== baseIndent || /\d/.test(m[2]) !== ordered) break;
      const width = m[0].length || m[1].length + m[2].length + 1;
      const item = [{ a: lines[i].a + Math.min(m[0].length, lines[i].b - lines[i].a), b: lines[i].b }];
      i++;
      while (i < lines.length) {
        const t = lineText(ctx, lines[i]);
        if (blank(ctx, lines[i])) {
          const next = lines.slice(i + 1).find((l) => !blank(ctx, l));
          if (!next || indentOf(lineText(ctx, next)) < Math.min(width, 2)) break;
          item.push(lines[i]); i++; continue;
        }
        const ind = indentOf(t);
        if (ind >= Math.min(width, 2) && ind > baseIndent) {
          item.push({ a: lines[i].a + Math.min(ind, width), b: lines[i].b }); i++; continue;
        }
        if (!startsBlock(ctx, lines[i]) && !blank(ctx, item[item.length - 1])) { // a lazy continuation
          item.push(lines[i]); i++; continue;
        }
        break;
      }
      const li = el('li');
      blocks(ctx, li, item);
      if (li.childElementCount === 1 && li.firstElementChild.tagName === 'P') { // a tight item
        li.append(...li.firstElementChild.childNodes);
        li.firstElementChild.remove();
      }
      node.append(li);
      while (i < lines.length && blank(ctx, lines[i])) {
        const next = lines.slice(i).find((l) => !blank(ctx, l));
        const nm = next && LIST_ITEM.exec(lineText(ctx, next));
        if (!nm || nm[1].length !== baseIndent) break;
        i++;
      }
    }
    parent.append(node);
    return i;
  }

  function cells(ctx, line) { // offset ranges of a table row's cells
    const s = ctx.src, out = [];
    let a = line.a, b = line.b;
    while (a < b && /\s/.test(s[a])) a++;
    while (b > a && /\s/.test(s[b - 1])) b--;
    if (s[a] === '|') a++;
    if (b > a && s[b - 1] === '|' && s[b - 2] !== '\\') b--;
    let start = a, ticks = false;
    for (let i = a; i <= b; i++) {
      if (i < b && s[i] === '\\') { i++; continue; }
      if (i < b && s[i] === '`') ticks = !ticks;
      if (i === b || (s[i] === '|' && !ticks)) {
        let x = start, y = i;
        while (x < y && /\s/.test(s[x])) x++;
        while (y > x && /\s/.test(s[y - 1])) y--;
        out.push([x, y]);
        start = i + 1;
      }
    }
    return out;
  }

  function table(ctx, parent, lines, i) {
    const node = el('table');
    const head = el('thead'), row = el('tr');
    const columns = cells(ctx, lines[i]).length;
    for (const [x, y] of cells(ctx, lines[i])) {
      const th = el('th');
      inline(ctx, th, x, y);
      row.append(th);
    }
    head.append(row);
    node.append(head);
    const bodyNode = el('tbody');
    i += 2;
    while (i < lines.length && !blank(ctx, lines[i]) && lineText(ctx, lines[i]).includes('|')) {
      const tr = el('tr');
      cells(ctx, lines[i]).slice(0, columns).forEach(([x, y]) => {
        const td = el('td');
        inline(ctx, td, x, y);
        tr.append(td);
      });
      bodyNode.append(tr);
      i++;
    }
    node.append(bodyNode);
    parent.append(node);
    return i;
  }

  function render(root, src, marks) {
    const lines = [];
    for (let a = 0; a <= src.length;) {
      let b = src.indexOf('\n', a);
      if (b === -1) b = src.length;
      lines.push({ a, b: b > a && src[b - 1] === '\r' ? b - 1 : b });
      a = b + 1;
    }
    root.replaceChildren();
    blocks({ src, marks }, root, lines);
  }

  window.Blockspec.markdown = { render };
})();
