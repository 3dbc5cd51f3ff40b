// What the page keeps in this browser (localStorage: conversations, settings, the API key) and the
// settings dialog's fields. Where storage is missing or blocked the page still works and keeps nothing.
'use strict';
(function (B) {
  const KEYS = { chats: 'blockspec.chats.v1', settings: 'blockspec.settings.v1', key: 'blockspec.apiKey' };
  const DEFAULTS = { system: '', temperature: 0.7, top_p: 0.95, top_k: 0, max_tokens: 512, seed: '',
    sources: true };
  const FIELDS = { system: 'set-system', temperature: 'set-temperature', top_p: 'set-top-p',
    top_k: 'set-top-k', max_tokens: 'set-max-tokens', seed: 'set-seed' };

  function raw(name) {
    try { return localStorage.getItem(name); } catch (err) { return null; }
  }

  function load(name, fallback) {
    try {
      const text = raw(name);
      return text === null ? fallback : JSON.parse(text);
    } catch (err) {
      return fallback;
    }
  }

  function store(name, value) {
    try {
      if (value === null) localStorage.removeItem(name);
      else localStorage.setItem(name, typeof value === 'string' ? value : JSON.stringify(value));
      return true;
    } catch (err) {
      return false;
    }
  }

  // Conversations with at least one message; over the browser's quota, the token colours of the oldest
  // replies go first, then whole conversations, oldest first.
  function saveChats(chats) {
    const keep = chats.filter((c) => c.messages.length);
    if (store(KEYS.chats, keep)) return;
    for (const chat of keep.slice().reverse()) {
      for (const msg of chat.messages) delete msg.tok;
      if (store(KEYS.chats, keep)) return;
    }
    while (keep.length > 1) {
      keep.pop();
      if (store(KEYS.chats, keep)) return;
    }
  }

  function loadChats() {
    const saved = load(KEYS.chats, []);
    const chats = Array.isArray(saved) ? saved.filter((c) => c && Array.isArray(c.messages)) : [];
    for (const chat of chats) {
      for (const msg of chat.messages) if (msg.state === 'streaming') msg.state = 'stopped';
    }
    return chats;
  }

  function fill(values, key) {
    for (const [name, id] of Object.entries(FIELDS)) B.$(id).value = values[name];
    B.$('set-api-key').value = key;
  }

  // The dialog's values, each clamped to what the server accepts (max_tokens to the model's context).
  function read(current, maxModelLen) {
    const next = { ...current };
    for (const [name, id] of Object.entries(FIELDS)) next[name] = B.$(id).value;
    const num = (v, lo, hi, d) => {
      const x = Number(v);
      return v !== '' && Number.isFinite(x) ? Math.min(hi, Math.max(lo, x)) : d;
    };
    next.temperature = num(next.temperature, 0, 2, DEFAULTS.temperature);
    next.top_p = num(next.top_p, 0.01, 1, DEFAULTS.top_p);
    next.top_k = Math.round(num(next.top_k, 0, 1e6, 0));
    next.max_tokens = Math.round(num(next.max_tokens, 1, maxModelLen || 1e6, DEFAULTS.max_tokens));
    next.seed = next.seed === '' || !Number.isFinite(Number(next.seed)) ? '' : Math.trunc(Number(next.seed));
    return next;
  }

  B.settings = {
    DEFAULTS, fill, read, saveChats, loadChats,
    load: () => ({ ...DEFAULTS, ...load(KEYS.settings, {}) }),
    save: (values) => store(KEYS.settings, values),
    key: () => raw(KEYS.key) || '',
    saveKey: (key) => store(KEYS.key, key || null),
  };
})(window.Blockspec);
