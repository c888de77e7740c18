// The config editor's filters and a run's live view (server-sent events, uPlot charts). No inline scripts: the
// page's Content-Security-Policy allows scripts from this server only.
"use strict";

function filterFields() {
  const search = document.getElementById("search");
  if (!search) return;
  const words = search.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
  const family = document.getElementById("family").value;
  const onlySet = document.getElementById("only-set").checked;
  document.querySelectorAll("#config-form .field").forEach((field) => {
    const text = field.textContent.toLowerCase();
    // An option of another family stays in view when it is set or has a problem: it is in the config.
    const families = field.dataset.families.split(" ").filter(Boolean);
    const setOrWrong = field.classList.contains("is-set") || field.classList.contains("has-problem");
    const shown = words.every((w) => text.includes(w)) &&
      (!family || !families.length || families.includes(family) || setOrWrong) && (!onlySet || setOrWrong);
    field.hidden = !shown;
  });
  document.querySelectorAll("#config-form details.group").forEach((group) => {
    const any = group.querySelector(".field:not([hidden])");
    group.hidden = !any;
    if ((words.length || onlySet) && any) group.open = true;
  });
  const firstProblem = document.querySelector("#config-form .field.has-problem");
  if (firstProblem) firstProblem.closest("details").open = true;
}

function loadOnEnter(e) {
  // The TOML box is inside the form: Enter there would submit the form (Check); it means Load.
  if (e.key !== "Enter") return;
  e.preventDefault();
  document.getElementById("load-button").click();
}

function followModel(offerDefaults = true) {
  // A model chosen in the form: its family (the trainer's own detection, on the server) picks the family filter,
  // and that family's recommended settings are offered (not when the form is only restored).
  const model = document.getElementById("opt-pretrained_model_name_or_path");
  const offer = document.getElementById("family-offer");
  fetch("/config/family?model=" + encodeURIComponent(model.value.trim())).then((r) => r.json()).then((found) => {
    markRequired(found.required || {});
    if (!offerDefaults) {
      if (found.family) document.getElementById("family").value = found.family;
      filterFields();
      return;
    }
    offer.replaceChildren();
    offer.hidden = !found.family;
    if (!found.family) return;
    document.getElementById("family").value = found.family;
    document.querySelector("#config-form input[name=_family_model]").value = model.value;
    filterFields();
    const settings = Object.entries(found.defaults);
    const text = document.createElement("span");
    text.textContent = found.family + " model: " + (settings.length ? "recommended (" + found.config + "): " +
      settings.map(([k, v]) => k + " " + v).join(", ") : "no recommended settings");
    offer.append(text);
    if (!settings.length) return;
    const use = document.createElement("button");
    use.type = "button";
    use.id = "use-family-defaults";
    use.textContent = "Use them";
    use.addEventListener("click", () => {
      settings.forEach(([name, value]) => {
        const field = document.getElementById("opt-" + name);
        if (!field) return;
        field.value = value;
        field.closest(".field").classList.add("is-set");
      });
      offer.hidden = true;
      filterFields();
      saveDraft();
    });
    offer.append(" ", use);
  });
}

function markRequired(required) {
  // The fields a run needs change with the model (a single file is loaded with its family's separate files).
  document.querySelectorAll("#config-form .field[data-name]").forEach((field) => {
    const why = required[field.dataset.name];
    let mark = field.querySelector(".required-mark");
    field.classList.toggle("required", Boolean(why));
    if (!why) { if (mark) mark.remove(); return; }
    if (!mark) {
      mark = document.createElement("abbr");
      mark.className = "required-mark";
      mark.textContent = "required";
      field.querySelector("label").append(" ", mark);
    }
    mark.title = why;
  });
}

const DRAFT = "lora-ui-form";  // this tab's form, so that leaving the page and coming back keeps its edits

function draftFields() {
  // Secrets never go to the browser's storage; the page's own controls (filters, example list) are not the config.
  return [...document.querySelectorAll("#config-form [name]")].filter((el) =>
    el.type !== "password" && (!el.name.startsWith("_") || el.name === "_prompts" || el.name === "_config_path"));
}

function saveDraft() {
  const values = {};
  draftFields().forEach((el) => { if (el.value) values[el.name] = el.value; });
  sessionStorage.setItem(DRAFT, JSON.stringify(values));
}

function restoreDraft() {
  // Only into an untouched form: one the server filled (a clone, a load) is not replaced.
  const form = document.getElementById("config-form");
  const saved = JSON.parse(sessionStorage.getItem(DRAFT) || "{}");
  if (!form || form.querySelector(".field.is-set") || !Object.keys(saved).length) return;
  draftFields().forEach((el) => {
    if (!(el.name in saved)) return;
    el.value = saved[el.name];
    const field = el.closest(".field");
    if (field) field.classList.add("is-set");
  });
  document.getElementById("form-message").textContent = "the unsaved edits of this tab are back";
  // The family filter is the page's, not the config's: it follows the restored model's family again.
  if (saved.pretrained_model_name_or_path) followModel(false);
}

function bindForm() {
  ["search", "family", "only-set"].forEach((id) => {
    const el = document.getElementById(id);
    if (el && !el.dataset.bound) {
      el.addEventListener("input", filterFields);
      el.dataset.bound = "1";
    }
  });
  const model = document.getElementById("opt-pretrained_model_name_or_path");
  if (model && !model.dataset.bound) {
    model.addEventListener("change", followModel);
    model.dataset.bound = "1";
  }
  const form = document.getElementById("config-form");
  if (form) {
    form.addEventListener("input", saveDraft);
    form.addEventListener("change", saveDraft);
    saveDraft();  // the form the server just sent (a load, a check) is the draft from now on
  }
  const path = document.getElementById("config-path");
  if (path && !path.dataset.bound) {
    path.addEventListener("keydown", loadOnEnter);
    path.addEventListener("input", () => { document.getElementById("config-path-problem").textContent = ""; });
    path.dataset.bound = "1";
  }
  filterFields();
}

document.addEventListener("click", (e) => {
  // A problem listed at the top of the form: go to its field (its group opened, the filters set aside).
  const link = e.target.closest("#problem-links a[data-field]");
  if (!link) return;
  e.preventDefault();
  const field = document.getElementById("field-" + link.dataset.field);
  field.hidden = false;
  field.closest("details").hidden = false;
  field.closest("details").open = true;
  field.scrollIntoView({block: "center"});
  const input = field.querySelector("input, select, textarea");
  if (input) input.focus({preventScroll: true});
});

document.addEventListener("click", (e) => {
  // The offer of a new output folder instead of one holding earlier work: the field takes it, nothing starts.
  const use = e.target.closest("#use-new-folder");
  if (!use) return;
  document.getElementById("opt-output_dir").value = use.dataset.folder;
  document.getElementById("new-folder-offer").remove();
  saveDraft();
});

document.addEventListener("click", (e) => {
  // "Keep it" under a question (deleting a run): the question goes, nothing else happens.
  const keep = e.target.closest("[data-dismiss]");
  if (keep) document.getElementById(keep.dataset.dismiss).remove();
});

document.addEventListener("htmx:beforeRequest", (e) => {
  // The runs list refreshes itself; not while it asks a question (deleting a run).
  if (e.detail.elt.id === "run-list" && e.detail.elt.querySelector(".confirm")) e.preventDefault();
});

document.addEventListener("htmx:beforeSwap", (e) => {
  // Problems come back with status 400 / 403 / 404: show them rather than dropping the response.
  if (e.detail.xhr.status >= 400 && e.detail.xhr.status < 500) {
    e.detail.shouldSwap = true;
    e.detail.isError = false;
  }
});
document.addEventListener("htmx:afterSwap", (e) => {
  if (e.detail.target && e.detail.target.id === "config-form" || e.detail.elt.id === "config-form") {
    // The search and filters live in the form: keep what was typed there.
    bindForm();
  }
});

function makeChart(el, title, xLabel) {
  const opts = {
    width: Math.max(320, el.clientWidth || 480), height: 240,
    scales: {x: {time: false}},
    series: [{label: xLabel}, {label: title, stroke: "#2563eb", width: 2, points: {show: true, size: 4}}],
    axes: [{label: xLabel}, {}],
  };
  return new uPlot(opts, [[], []], el);
}

function fmtDuration(seconds) {
  if (!isFinite(seconds) || seconds < 0) return "–";
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + (s % 60) + "s";
}

function postForm(url, data) {
  const body = new URLSearchParams(data);
  return fetch(url, {method: "POST", body, credentials: "same-origin"}).then((r) => r.text().then((t) => [r.ok, t]));
}

function runView() {
  const view = document.getElementById("run-view");
  if (!view) return;
  const dir = view.dataset.dir;
  const q = "path=" + encodeURIComponent(dir);
  const lossEl = document.getElementById("loss-chart");
  const binsEl = document.getElementById("bins-chart");
  const loss = makeChart(lossEl, "loss", "step");
  const bins = makeChart(binsEl, "mean loss", "timestep");
  const steps = [], losses = [], speeds = [];
  let total = null;
  let runState = null;  // the last status: speed and ETA only while running

  function onRun(event) {
    if (event.event === "plan") {
      // Each attempt on the folder plans from its first step: a resume from its state's (the steps after it are
      // trained again), a new run from 0. The chart keeps the run's history up to there.
      const kept = steps.findIndex((s) => s > event.step);
      if (kept >= 0) { steps.length = kept; losses.length = kept; speeds.length = kept; }
      loss.setData([steps, losses]);
      lossEl.dataset.points = String(steps.length);
      total = event.total_steps;
      document.getElementById("run-total").textContent = total;
    } else if (event.event === "step") {
      steps.push(event.step); losses.push(event.loss); speeds.push(event.s_per_step);
      loss.setData([steps, losses]);
      lossEl.dataset.points = String(steps.length);
      total = event.total_steps || total;
      document.getElementById("run-step").textContent = event.step;
      document.getElementById("run-loss").textContent = event.loss.toFixed(4);
      const recent = speeds.slice(-20);
      const mean = recent.reduce((a, b) => a + b, 0) / recent.length;
      if (runState === null || runState === "running") {
        document.getElementById("run-speed").textContent = event.s_per_step.toFixed(3);
        if (total) document.getElementById("run-eta").textContent = fmtDuration((total - event.step) * mean);
      }
      const mids = event.timestep_loss.map((b) => (b[0] + b[1]) / 2);
      bins.setData([mids, event.timestep_loss.map((b) => b[2])]);
      binsEl.dataset.points = String(mids.length);
    }
  }

  function fileUrl(rel, download) {
    return "/files?path=" + encodeURIComponent(dir + "/" + rel) + (download ? "&download=1" : "");
  }

  function sampleFigure(sample) {
    const fig = document.createElement("figure");
    fig.className = "thumb sample";
    const link = document.createElement("a");
    link.href = fileUrl(sample.path, false);
    link.target = "_blank";
    // A video sample (.mp4, .webm) plays; an image, or an animated .webp, shows as an image.
    const media = document.createElement(sample.video ? "video" : "img");
    media.src = link.href;
    if (sample.video) {
      Object.assign(media, {controls: true, loop: true, muted: true, autoplay: true, playsInline: true});
      fig.append(media);
    } else {
      media.alt = sample.prompt;
      link.append(media);
    }
    const cap = document.createElement("figcaption");
    cap.textContent = sample.prompt || sample.path.replace(/^sample\//, "");
    cap.title = sample.path.replace(/^sample\//, "");
    const save = document.createElement("a");
    save.href = fileUrl(sample.path, true);
    save.className = "download";
    save.textContent = "download";
    fig.append(link, cap, save);
    return fig;
  }

  function showSamples(samples) {
    // Grouped by the step (or epoch) they were made at, the newest first, each with its prompt.
    const box = document.getElementById("samples");
    const key = JSON.stringify(samples);
    if (box.dataset.key === key) return;
    box.dataset.key = key;
    const groups = new Map();
    samples.forEach((sample) => {
      if (!groups.has(sample.when)) groups.set(sample.when, []);
      groups.get(sample.when).push(sample);
    });
    box.replaceChildren(...[...groups.entries()].reverse().map(([when, items]) => {
      const section = document.createElement("section");
      section.className = "sample-group";
      section.dataset.when = when;
      const title = document.createElement("h4");
      title.textContent = when || "samples";
      const thumbs = document.createElement("div");
      thumbs.className = "thumbs";
      thumbs.append(...items.map(sampleFigure));
      section.append(title, thumbs);
      return section;
    }));
  }

  function listFiles(id, names, withMetadata) {
    const list = document.getElementById(id);
    const known = new Set([...list.children].map((li) => li.dataset.name));
    names.forEach((name) => {
      if (known.has(name)) return;
      const li = document.createElement("li");
      li.dataset.name = name;
      li.textContent = name + " ";
      if (withMetadata) {
        const save = document.createElement("a");
        save.href = fileUrl(name, true);
        save.className = "download";
        save.textContent = "download";
        li.append(save, " ");
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = "metadata";
        button.addEventListener("click", () => {
          fetch("/lora?path=" + encodeURIComponent(dir + "/" + name)).then((r) => r.json()).then((info) => {
            const pre = document.getElementById("lora-metadata");
            pre.hidden = false;
            pre.textContent = name + " (" + info.bytes + " bytes)\n" + Object.entries(info.metadata || {})
              .map(([k, v]) => k + " = " + v).join("\n");
          });
        });
        li.append(button);
      }
      list.append(li);
    });
  }

  function onStatus(s) {
    const el = document.getElementById("run-status");
    el.textContent = s.status;
    el.className = "status-" + s.status.replace(" ", "-");
    runState = s.status;
    document.getElementById("run-phase").textContent = s.phase && s.phase !== "training" ? s.phase : "";
    document.getElementById("run-message").textContent = s.message || "";
    document.getElementById("run-duration").textContent = s.duration == null ? "–" : fmtDuration(s.duration);
    if (s.status !== "running") {
      // A run that ended has no speed or time left; a Stop's "stopping..." is answered by the status itself.
      document.getElementById("run-speed").textContent = "–";
      document.getElementById("run-eta").textContent = "–";
      const result = document.getElementById("action-result");
      if (result.textContent.startsWith("stopping")) result.textContent = "";
    }
    if (s.log_tail && s.log_tail.length) document.getElementById("log").textContent = s.log_tail.join("\n");
    listFiles("files", s.files, true);
    listFiles("states", s.states, false);
    showSamples(s.samples || []);
    const running = s.status === "running" && s.phase !== "stopping";
    const asked = s.requests || [];
    document.getElementById("sample-button").disabled = !running || !s.can_sample || asked.includes("sample_now");
    document.getElementById("save-button-now").disabled = !running || asked.includes("save_now");
    document.getElementById("delete-button").disabled = s.status === "running" || s.status === "queued";
    const said = document.getElementById("action-result");  // an answered request's "asked for" goes
    if ((said.textContent.startsWith("samples asked") && !asked.includes("sample_now")) ||
        (said.textContent.startsWith("a LoRA file asked") && !asked.includes("save_now"))) said.textContent = "";
    // Only a running run, or one this UI holds in its queue: a run queued on disk that it never took up is not its.
    document.getElementById("stop-button").disabled = !s.stoppable;
    document.getElementById("resume-button").disabled = !s.can_resume;
  }

  let source = null;
  function connect() {
    if (source) source.close();
    steps.length = 0; losses.length = 0; speeds.length = 0;  // the stream starts from the first event again
    source = new EventSource("/runs/events?" + q);
    source.addEventListener("run", (e) => onRun(JSON.parse(e.data)));
    source.addEventListener("status", (e) => onStatus(JSON.parse(e.data)));
    source.addEventListener("done", () => source.close());
  }
  connect();

  document.getElementById("stop-button").addEventListener("click", () => {
    postForm("/runs/stop", {path: dir}).then(([, t]) => { document.getElementById("action-result").innerHTML = t; });
  });
  const result = document.getElementById("action-result");
  [["sample-button", "sample"], ["save-button-now", "save"]].forEach(([id, what]) => {
    document.getElementById(id).addEventListener("click", () => {
      postForm("/runs/request", {path: dir, what}).then(([, t]) => { result.innerHTML = t; });
    });
  });
  document.getElementById("delete-button").addEventListener("click", () => {
    postForm("/runs/delete", {path: dir}).then(([, t]) => {
      result.innerHTML = t;
      htmx.process(result);  // the question carries its own buttons
    });
  });
  document.getElementById("resume-button").addEventListener("click", () => {
    postForm("/runs/resume", {path: dir}).then(([ok, t]) => {
      const result = document.getElementById("action-result");
      result.innerHTML = t;
      htmx.process(result);  // a finished run's question carries its own buttons
      if (ok) setTimeout(connect, 500);
    });
  });
}

document.addEventListener("DOMContentLoaded", () => { restoreDraft(); bindForm(); runView(); });
