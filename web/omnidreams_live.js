// OmniVideo: the panel of the OmniDreams Live node. A plain ES module (no build step), loaded by both supported
// frontends (1.27 in ComfyUI 0.3.64, 1.49 in 0.33) from the pack's WEB_DIRECTORY.
//
// Each run gets a key the panel makes and keeps (32 random bytes, base64url): only its SHA-256 goes into the queued
// prompt (the node's hidden key_hash input), because ComfyUI's client_id, /queue and /history are public on a shared
// server. The key hash is also the session's id. The panel learns that its run started from the node's
// "omnivideo.live" message (no secret in it), or by asking for its key hashes itself when that message went to someone
// else; then it opens the session's /frames websocket (the key as a subprotocol; 16-byte big-endian header: uint32
// frame, uint32 chunk, float64 the server's time.time() at decode; then a JPEG), queues the frames and shows them at
// the session's fps, polls the status route for the state line and posts the user's events (prompt, pause, resume,
// stop, more), every request with the key in the X-OmniVideo-Live-Key header.
//
// For tests and benchmarks each panel keeps its numbers on window.omnivideoLive.panels[<node id>] (and a few on the
// panel element's dataset): frames received / shown / dropped, per-frame frames-to-screen latency in ms (the time a
// frame was drawn minus the server time in its header: the same clock when browser and server share a machine).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPE = "OmniDreamsLive";
const HEADER_BYTES = 16;
const STATUS_POLL_MS = 500;
const MAX_LATENCIES = 10000; // a long session keeps its last 10k frames' numbers
const MAX_BUFFER_S = 2; // more than this much video waiting to be shown: drop the oldest frames (live, not a replay)
const MAX_PROMPT_CHARS = 65536; // as the server takes one (a whole prompt schedule's length)
const KEY_HEADER = "X-OmniVideo-Live-Key";
const KEY_PROTOCOLS = (key) => ["omnivideo-live", `omnivideo-key.${key}`];
const MAX_KEYS = 32; // keys of runs this page queued and has not seen end (the oldest are forgotten first)
const KEY_LIFETIME_MS = 12 * 3600 * 1000; // a key whose run never started (refused, deleted from the queue) goes
const FIND_EVERY_MS = 2000; // how often a panel asks whether one of its runs started (when no message told it)
const FIND_AT_ONCE = 4; // keys asked about per round, the oldest first (ComfyUI runs its queue in order)

// The keys of the runs queued from this page: key hash -> {key, node: the node id, made: Date.now()}. Kept for the
// page's life, not the panel's (a workflow tab switch or reload of the graph makes new panels, which find their
// node's runs here) and never in the workflow. A key goes when its session has ended.
const runKeys = new Map();

// The queued runs of a node (a key made for a prompt that was never sent or was refused is not asked about).
function keysOf(node) {
    const now = Date.now();
    for (const [hash, entry] of runKeys) if (now - entry.made > KEY_LIFETIME_MS) runKeys.delete(hash);
    return [...runKeys].filter(([, entry]) => entry.queued && entry.node === String(node.id));
}

// The key hashes a prompt's OmniDreams Live nodes carry (the API graph the frontend sends to /prompt).
function keyHashesIn(output) {
    const hashes = [];
    for (const node of Object.values(output || {})) {
        const hash = node?.class_type === "OmniDreamsLive" ? node.inputs?.key_hash : null;
        if (typeof hash === "string" && runKeys.has(hash)) hashes.push(hash);
    }
    return hashes;
}

// Marks the keys of each prompt ComfyUI took (a refused prompt's keys go): only those are looked for. Wraps the
// frontend's api.queuePrompt (number, {output, workflow}, ...), whatever else it does.
function followQueuedPrompts() {
    const queuePrompt = api.queuePrompt;
    if (typeof queuePrompt !== "function" || queuePrompt.omnivideoLive) return;
    const wrapped = async function (...args) {
        const hashes = keyHashesIn(args[1]?.output);
        try {
            const answer = await queuePrompt.apply(this, args);
            for (const hash of hashes) {
                const entry = runKeys.get(hash);
                if (entry) Object.assign(entry, { queued: true, prompt: answer?.prompt_id ?? null });
            }
            for (const panel of panels) if (hashes.length) panel.startFinding();
            return answer;
        } catch (err) {
            for (const hash of hashes) runKeys.delete(hash);
            throw err;
        }
    };
    wrapped.omnivideoLive = true;
    api.queuePrompt = wrapped;
}

// SHA-256 of an ASCII string as 64 hex digits (the key hash). Plain JS: crypto.subtle exists only in a secure
// context (https or localhost), and ComfyUI on a shared server is often reached over plain http.
const K256 = new Uint32Array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
]);

function sha256hex(ascii) {
    const bytes = new TextEncoder().encode(ascii);
    const length = Math.ceil((bytes.length + 9) / 64) * 64;
    const data = new Uint8Array(length);
    data.set(bytes);
    data[bytes.length] = 0x80;
    new DataView(data.buffer).setUint32(length - 4, bytes.length * 8);
    const h = new Uint32Array([
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
    ]);
    const w = new Uint32Array(64);
    const rotr = (x, n) => (x >>> n) | (x << (32 - n));
    for (let offset = 0; offset < length; offset += 64) {
        const block = new DataView(data.buffer, offset, 64);
        for (let i = 0; i < 16; i++) w[i] = block.getUint32(i * 4);
        for (let i = 16; i < 64; i++) {
            const s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >>> 3);
            const s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >>> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        let [a, b, c, d, e, f, g, hh] = h;
        for (let i = 0; i < 64; i++) {
            const t1 = (hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i]) >>> 0;
            const t2 = ((rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) >>> 0;
            [hh, g, f, e, d, c, b, a] = [g, f, e, (d + t1) >>> 0, c, b, a, (t1 + t2) >>> 0];
        }
        [a, b, c, d, e, f, g, hh].forEach((v, i) => (h[i] = (h[i] + v) >>> 0));
    }
    return [...h].map((v) => v.toString(16).padStart(8, "0")).join("");
}

// A new key: 32 random bytes as base64url (getRandomValues works outside secure contexts too).
function newKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(32));
    return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

const panels = new Set(); // every LivePanel of the page's graphs
// window.omnivideoLive.panels: {<node id>: stats} (computed: a node gets its id when it is added to a graph)
const live = (window.omnivideoLive = { sessions: {} });
Object.defineProperty(live, "panels", {
    get: () => Object.fromEntries([...panels].map((p) => [String(p.node.id), p.stats])),
});
// window.omnivideoLive.runs: the runs whose keys the page holds, without the keys: [{node, queued, prompt}]
Object.defineProperty(live, "runs", {
    get: () => [...runKeys.values()].map(({ node, queued, prompt }) => ({ node, queued, prompt: prompt ?? null })),
});

const wallMs = () => performance.timeOrigin + performance.now();

function el(tag, props = {}, style = {}) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
        if (key === "testid") node.dataset.testid = value;
        else node[key] = value;
    }
    Object.assign(node.style, style);
    return node;
}

// Keys typed into the panel's fields are theirs, not the canvas shortcuts' (Delete, Ctrl+A, ...).
function ownKeys(field) {
    for (const type of ["keydown", "keyup", "keypress"]) field.addEventListener(type, (e) => e.stopPropagation());
}

const livePath = (session, rest = "") => `/omnivideo/live/${encodeURIComponent(session)}${rest}`;

function socketURL(path) {
    const url = new URL(api.apiURL(path), window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    return url.toString();
}

// The "omnivideo.live" message names the node as ComfyUI's "executing" does: its id, or "<subgraph path>:<id>".
// No guessing beyond that: a session of a workflow in another tab must not take over this one's panel.
function panelFor(nodeName) {
    const name = String(nodeName);
    for (const id of [name, name.split(":").pop()]) {
        const match = [...panels].filter((p) => String(p.node.id) === id);
        if (match.length === 1) return match[0];
    }
    return null;
}

class LivePanel {
    constructor(node) {
        this.node = node;
        this.session = null; // the session on screen: {session (its id, the key hash), key, fps, width, height, ...}
        this.findTimer = null;
        this.socket = null;
        this.queue = []; // decoded frames waiting for their turn: {index, chunk, serverTime, received, bitmap}
        this.nextDue = 0; // performance.now() at which the next frame may be shown
        this.pollTimer = null;
        this.wantPaused = false; // a pause was asked for (it applies at the next chunk boundary) and not resumed
        this.stats = this.freshStats(null);
        this.build();
        panels.add(this);
        this.render();
        this.startFinding(); // a run of this node queued before this panel existed (another tab, a reload)
    }

    freshStats(session) {
        return {
            session: session ? session.session : null, // the session's id: its key hash (public)
            fps: session ? session.fps : null,
            state: session ? session.state : "idle",
            reason: null,
            framesReceived: 0,
            framesShown: 0,
            framesDropped: 0,
            lastFrame: null, // {index, chunk} of the frame on screen
            latencyMs: [], // per frame shown: display time - the header's server time
            arrivalMs: [], // per frame received: arrival time - the header's server time
            decodeMs: [], // per frame received: JPEG decoded - arrival
            status: null, // the last GET /omnivideo/live/{session} answer
            ended: null, // the "ended" message
            sent: [], // events this panel posted: {type, id, state} or {type, error}
            error: null,
        };
    }

    build() {
        const root = el(
            "div",
            { testid: "omnidreams-live-panel", className: "omnidreams-live-panel" },
            { display: "flex", flexDirection: "column", gap: "4px", width: "100%", height: "100%",
              boxSizing: "border-box", fontSize: "12px", color: "var(--input-text, #ddd)" },
        );
        this.canvas = el(
            "canvas",
            { testid: "omnidreams-live-canvas", width: 64, height: 48 },
            { flex: "1 1 auto", minHeight: "0", width: "100%", objectFit: "contain", background: "#000",
              borderRadius: "4px" },
        );
        this.stateLine = el(
            "div",
            { testid: "omnidreams-live-state", textContent: "idle: queue the workflow to start a session" },
            { minHeight: "2.6em", overflowWrap: "anywhere", opacity: "0.9" },
        );
        this.prompt = el(
            "textarea",
            { testid: "omnidreams-live-prompt", rows: 2, placeholder: "New prompt (applies from the next chunk)",
              maxLength: MAX_PROMPT_CHARS },
            { width: "100%", boxSizing: "border-box", resize: "none", fontSize: "12px",
              background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
              border: "1px solid var(--border-color, #444)", borderRadius: "4px" },
        );
        ownKeys(this.prompt);
        const buttonStyle = { flex: "0 0 auto", fontSize: "12px", padding: "2px 8px", cursor: "pointer" };
        this.sendButton = el("button", { testid: "omnidreams-live-send", textContent: "Send" }, buttonStyle);
        this.pauseButton = el("button", { testid: "omnidreams-live-pause", textContent: "Pause" }, buttonStyle);
        this.stopButton = el("button", { testid: "omnidreams-live-stop", textContent: "Stop" }, buttonStyle);
        this.moreCount = el(
            "input",
            { testid: "omnidreams-live-more-count", type: "number", min: 1, max: 900, step: 1, value: 8,
              title: "Chunks to add" },
            { width: "4em", fontSize: "12px" },
        );
        this.moreButton = el("button", { testid: "omnidreams-live-more", textContent: "+8 more" }, buttonStyle);
        this.moreCount.addEventListener("input", () => (this.moreButton.textContent = `+${this.moreChunks()} more`));
        ownKeys(this.moreCount);

        this.sendButton.addEventListener("click", () => this.sendPrompt());
        this.pauseButton.addEventListener("click", () => this.post({ type: this.wantPaused ? "resume" : "pause" }));
        this.stopButton.addEventListener("click", () => this.post({ type: "stop" }));
        this.moreButton.addEventListener("click", () => this.post({ type: "more", chunks: this.moreChunks() }));

        const row = el("div", {}, { display: "flex", gap: "4px", alignItems: "center", flexWrap: "wrap" });
        row.append(this.sendButton, this.pauseButton, this.stopButton, this.moreCount, this.moreButton);
        root.append(this.canvas, this.stateLine, this.prompt, row);
        this.root = root;
        this.ctx = this.canvas.getContext("2d");
    }

    moreChunks() {
        const n = Math.round(Number(this.moreCount.value));
        return Number.isFinite(n) ? Math.min(Math.max(n, 1), Number(this.moreCount.max) || 900) : 8;
    }

    active() {
        return !!this.session && this.stats.state !== "ended";
    }

    // ------------------------------------------------------------------ the session

    // A fresh key for the run being queued: its hash goes into the prompt (key_hash), the key stays here.
    newRunKey() {
        const key = newKey();
        const hash = sha256hex(key);
        runKeys.set(hash, { key, node: String(this.node.id), made: Date.now(), queued: false });
        while (runKeys.size > MAX_KEYS) runKeys.delete(runKeys.keys().next().value);
        return hash;
    }

    // Whether a run queued from here started, asked with its own keys (ComfyUI sends the node's message to the
    // newest socket of this client_id only, which may not be this page's).
    startFinding() {
        if (this.findTimer === null) this.findTimer = setInterval(() => this.findOnce(), FIND_EVERY_MS);
    }

    async findOnce() {
        const mine = keysOf(this.node);
        if (this.active() || !mine.length) {
            if (!mine.length) this.stopFinding();
            return;
        }
        for (const [hash, { key }] of mine.slice(0, FIND_AT_ONCE)) {
            try {
                const res = await api.fetchApi(livePath(hash), { headers: { [KEY_HEADER]: key } });
                if (!res.ok || this.active()) continue; // 404: not started yet
                const status = await res.json();
                if (status.state === "ended") runKeys.delete(hash);
                else return this.onSession({ ...status, session: hash, state: status.state });
            } catch (err) {
                this.stats.error = `status: ${err}`;
            }
        }
    }

    stopFinding() {
        if (this.findTimer !== null) clearInterval(this.findTimer);
        this.findTimer = null;
    }

    onSession(message) {
        const key = runKeys.get(message.session)?.key;
        if (message.state === "ended") {
            runKeys.delete(message.session);
            if (!this.session || message.session !== this.session.session) return;
            this.stats.state = "ended";
            this.stats.reason = message.reason || null;
            this.stats.ended = message;
            this.stopPolling();
            this.pollOnce(); // the events' final chunks, while the server still knows the session
            this.render();
            return;
        }
        if (key === undefined) return; // not a run of this panel: without its key there is nothing to show
        if (this.session && this.session.session === message.session) return; // found twice
        this.close();
        this.session = { ...message, key };
        this.stats = this.freshStats(message);
        this.wantPaused = false;
        this.moreCount.max = message.max_chunks || 900;
        live.sessions[message.session] = this.stats;
        this.queue = [];
        this.nextDue = 0;
        if (message.width > 0 && message.height > 0) {
            this.canvas.width = message.width;
            this.canvas.height = message.height;
        }
        this.ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
        this.openFrames();
        this.startPolling();
        this.render();
    }

    openFrames() {
        const { session, key } = this.session;
        const socket = new WebSocket(socketURL(livePath(session, "/frames")), KEY_PROTOCOLS(key));
        socket.binaryType = "arraybuffer";
        socket.onmessage = (e) => this.onFrame(e.data);
        socket.onerror = () => {
            if (this.socket === socket && this.active()) this.stats.error = "the frames websocket failed";
            this.render();
        };
        this.socket = socket;
        this.ensurePlaying();
    }

    async onFrame(data) {
        if (!(data instanceof ArrayBuffer) || data.byteLength <= HEADER_BYTES) return;
        const received = wallMs();
        const view = new DataView(data, 0, HEADER_BYTES);
        const frame = { index: view.getUint32(0), chunk: view.getUint32(4), serverTime: view.getFloat64(8), received };
        const stats = this.stats;
        stats.framesReceived += 1;
        stats.arrivalMs.push(received - frame.serverTime * 1000);
        if (stats.arrivalMs.length > MAX_LATENCIES) stats.arrivalMs.shift();
        try {
            const jpeg = new Blob([new Uint8Array(data, HEADER_BYTES)], { type: "image/jpeg" });
            frame.bitmap = await createImageBitmap(jpeg);
            stats.decodeMs.push(wallMs() - received);
            if (stats.decodeMs.length > MAX_LATENCIES) stats.decodeMs.shift();
        } catch (err) {
            stats.error = `a frame did not decode: ${err}`;
            return;
        }
        if (stats !== this.stats) return; // a new session started meanwhile
        this.queue.push(frame);
        this.queue.sort((a, b) => a.index - b.index); // decodes can finish out of order
        const limit = Math.max(1, Math.round((this.session.fps || 30) * MAX_BUFFER_S));
        while (this.queue.length > limit) {
            this.queue.shift().bitmap.close?.();
            stats.framesDropped += 1;
        }
        this.ensurePlaying();
    }

    ensurePlaying() {
        if (!this.playing) {
            this.playing = true;
            requestAnimationFrame((t) => this.tick(t));
        }
    }

    // One frame per 1/fps, drawn on the animation frame where its turn comes.
    tick(now) {
        if (this.queue.length && now >= this.nextDue) {
            const frame = this.queue.shift();
            const period = 1000 / (this.session?.fps || 30);
            // behind by more than a frame (the first one, a gap in the stream): restart the clock at this frame
            this.nextDue = now - this.nextDue > period ? now + period : this.nextDue + period;
            this.ctx.drawImage(frame.bitmap, 0, 0, this.canvas.width, this.canvas.height);
            frame.bitmap.close?.();
            const stats = this.stats;
            stats.framesShown += 1;
            stats.lastFrame = { index: frame.index, chunk: frame.chunk };
            stats.latencyMs.push(wallMs() - frame.serverTime * 1000);
            if (stats.latencyMs.length > MAX_LATENCIES) stats.latencyMs.shift();
            this.render();
        }
        const more = this.queue.length || (this.socket && this.socket.readyState <= WebSocket.OPEN);
        if (more && !this.removed) requestAnimationFrame((t) => this.tick(t));
        else this.playing = false;
    }

    startPolling() {
        this.stopPolling();
        this.pollTimer = setInterval(() => this.pollOnce(), STATUS_POLL_MS);
        this.pollOnce();
    }

    stopPolling() {
        if (this.pollTimer !== null) clearInterval(this.pollTimer);
        this.pollTimer = null;
    }

    async pollOnce() {
        const session = this.session;
        if (!session) return;
        try {
            const res = await api.fetchApi(livePath(session.session), { headers: { [KEY_HEADER]: session.key } });
            if (session !== this.session) return;
            if (res.status === 404) {
                if (this.stats.state !== "ended") this.stats.state = "ended"; // forgotten: it ended long ago
                runKeys.delete(session.session);
                this.stopPolling();
            } else if (res.ok) {
                const status = await res.json();
                this.stats.status = status;
                if (this.stats.state !== "ended") this.stats.state = status.state;
                if (status.state === "ended") {
                    runKeys.delete(session.session);
                    this.stats.state = "ended";
                    this.stats.reason = this.stats.reason || status.reason;
                    this.stopPolling();
                }
            }
        } catch (err) {
            this.stats.error = `status: ${err}`;
        }
        this.render();
    }

    // ------------------------------------------------------------------ events

    sendPrompt() {
        const text = this.prompt.value.trim();
        if (!text) {
            this.stats.error = "type a prompt first";
            this.render();
            return;
        }
        this.post({ type: "prompt", text });
    }

    async post(event) {
        if (!this.active()) {
            this.stats.error = "no running session: queue the workflow first";
            this.render();
            return null;
        }
        let record;
        try {
            const res = await api.fetchApi(livePath(this.session.session, "/events"), {
                method: "POST",
                headers: { "Content-Type": "application/json", [KEY_HEADER]: this.session.key },
                body: JSON.stringify(event),
            });
            const body = await res.json().catch(() => ({}));
            if (res.ok) {
                record = { type: event.type, id: body.id, state: body.state };
                if (event.type === "pause" || event.type === "resume") this.wantPaused = event.type === "pause";
                if (body.state && this.stats.state !== "ended") this.stats.state = body.state;
                this.stats.error = null;
            } else {
                record = { type: event.type, status: res.status, error: body.error || `HTTP ${res.status}` };
                this.stats.error = `${event.type} refused: ${record.error}`;
            }
        } catch (err) {
            record = { type: event.type, error: String(err) };
            this.stats.error = `${event.type} failed: ${err}`;
        }
        this.stats.sent.push(record);
        this.render();
        this.pollOnce();
        return record;
    }

    // ------------------------------------------------------------------ what it shows

    describe() {
        const s = this.stats;
        const status = s.status;
        if (!this.session) return "idle: queue the workflow to start a session";
        const parts = [];
        if (s.state === "ended") parts.push(`ended (${s.reason || "?"})`);
        else if (s.state === "waiting") parts.push("waiting for more chunks");
        else if (s.state === "running" && this.wantPaused) parts.push("running, pauses at the next chunk");
        else parts.push(s.state);
        if (status) parts.push(`chunk ${status.made ?? status.chunk}/${status.target}`);
        else if (s.ended) parts.push(`${s.ended.chunks} chunks`);
        parts.push(`shown ${s.framesShown}/${s.framesReceived}`);
        const lat = s.latencyMs;
        if (lat.length) parts.push(`${Math.round(lat[lat.length - 1])} ms`);
        const applied = (status?.events || []).filter((e) => e.type === "prompt" && e.chunk != null);
        if (applied.length) parts.push(`prompt at chunk ${applied[applied.length - 1].chunk}`);
        if (status?.hdmap?.pushed) {
            const waiting = status.hdmap.waiting ? ", waiting for frames" : "";
            parts.push(`hd-map frames queued ${status.hdmap.queued}${waiting}`);
        }
        if (s.error) parts.push(s.error);
        return parts.join(" · ");
    }

    render() {
        const s = this.stats;
        this.stateLine.textContent = this.describe();
        this.stateLine.title = this.stateLine.textContent;
        const d = this.root.dataset;
        d.state = s.state;
        d.session = s.session || "";
        d.framesReceived = String(s.framesReceived);
        d.framesShown = String(s.framesShown);
        d.chunk = s.status ? String(s.status.chunk) : "";
        const on = this.active();
        this.sendButton.disabled = !on;
        this.stopButton.disabled = !on;
        this.moreButton.disabled = !on;
        this.pauseButton.disabled = !on;
        // a pause takes effect at the next chunk boundary: the button offers Resume as soon as it is asked for
        this.pauseButton.textContent = this.wantPaused ? "Resume" : "Pause";
        this.pauseButton.dataset.action = this.wantPaused ? "resume" : "pause";
    }

    close() {
        this.stopPolling();
        if (this.socket) {
            this.socket.onmessage = null;
            this.socket.close();
        }
        this.socket = null;
        for (const frame of this.queue) frame.bitmap?.close?.();
        this.queue = [];
    }

    remove() {
        this.removed = true;
        this.stopFinding();
        this.close();
        panels.delete(this);
    }
}

// key_hash: filled with a fresh key's hash each time the prompt is built (so each queued run has its own key), never
// shown and never saved in the workflow (it belongs to the run, not to the graph).
function hideKeyWidget(node, panel) {
    const widget = node.widgets?.find((w) => w.name === "key_hash");
    if (!widget) return;
    widget.serializeValue = () => panel.newRunKey();
    widget.serialize = false;
    widget.hidden = true;
    widget.type = "hidden";
    widget.computeSize = () => [0, -4];
}

function attachPanel(node) {
    if (node.omnidreamsLive) return;
    const panel = new LivePanel(node);
    node.omnidreamsLive = panel;
    hideKeyWidget(node, panel);
    const widget = node.addDOMWidget("live", "omnidreams_live", panel.root, {
        serialize: false, // UI only: not a widget value of the workflow nor an input of the prompt
        hideOnZoom: false,
        getMinHeight: () => 280,
        getValue: () => "",
        setValue: () => {},
    });
    widget.serialize = false;
    const [width, height] = node.size;
    node.setSize?.([Math.max(width, 360), Math.max(height, 560)]);
    const onRemoved = node.onRemoved;
    node.onRemoved = function () {
        panel.remove();
        return onRemoved?.apply(this, arguments);
    };
}

app.registerExtension({
    name: "omnivideo.OmniDreamsLive",
    async setup() {
        followQueuedPrompts();
        api.addEventListener("omnivideo.live", (e) => {
            const message = e.detail || {};
            if (typeof message.session !== "string") return; // a session nobody steers (no key) or not ours
            const panel = panelFor(message.node);
            if (panel) panel.onSession(message);
            else live.sessions[message.session] = { orphan: message }; // a node not in this graph (another tab)
        });
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (nodeData?.name !== NODE_TYPE) return;
        const onNodeCreated = nodeType.prototype.onNodeCreated;
        nodeType.prototype.onNodeCreated = function () {
            const result = onNodeCreated?.apply(this, arguments);
            attachPanel(this);
            return result;
        };
    },
});
