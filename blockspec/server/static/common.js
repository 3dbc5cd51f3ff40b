// The chat page's shared helpers, under one global, Blockspec; each other script adds its part to it
// (markdown, reply, stream, live) and chat.js wires them together. Scripts run in order (defer).
'use strict';
window.Blockspec = {
  $: (id) => document.getElementById(id),

  // An element; text goes in as a text node (never parsed as HTML).
  el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  },

  fmt: (x, digits) => (Number.isFinite(x) ? x.toFixed(digits) : '–'),
  pct: (x) => (Number.isFinite(x) ? Math.round(100 * x) + '%' : '–'),

  // Sources as the API names them, as one letter each in a stored reply, and in words.
  LETTER: { draft: 'd', lookup: 'l', target: 't' },
  WORD: { d: 'draft', l: 'lookup', t: 'target' },
  SOURCE_NAMES: { draft: 'accepted from the DFlash draft', lookup: 'copied from the context (prompt lookup)',
    target: 'produced by the target itself' },
};
