// The interactive quiz: instant feedback with the chosen option's explanation, numeric answers
// with their tolerance, a running score, progress in localStorage, and a reset.
(function () {
  var section = document.getElementById("quiz");
  var lesson = section.dataset.lesson;
  var quiz = JSON.parse(document.getElementById("quiz-data").textContent);
  var container = document.getElementById("quiz-questions");
  var letters = "ABCDEFGH";

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function updateScore() {
    var s = CourseProgress.summary(lesson, quiz.questions.length);
    document.getElementById("quiz-score").textContent =
      "Score: " + s.correct + " / " + s.total + " (" + s.answered + " answered)";
  }

  function grade(q, form) {
    if (q.type === "numeric") {
      var raw = form.querySelector("input").value.replace(/[,_\s]/g, "");
      var value = Number(raw);
      if (raw === "" || !isFinite(value)) return null;
      var ok = Math.abs(value - q.answer) <= q.tolerance;
      return { correct: ok, lines: [ok ? "Correct!" : "Not quite.",
        "Answer: " + q.answer + " " + q.unit + (q.tolerance ? " (within " + q.tolerance + ")" : "") + ".",
        q.explanation] };
    }
    var chosen = [];
    form.querySelectorAll("input").forEach(function (input, i) { if (input.checked) chosen.push(i); });
    if (!chosen.length) return null;
    var right = [];
    q.options.forEach(function (o, i) { if (o.correct) right.push(i); });
    var ok = chosen.length === right.length && chosen.every(function (i) { return right.indexOf(i) >= 0; });
    var lines = [ok ? "Correct!" : "Not quite."];
    q.options.forEach(function (o, i) {
      var picked = chosen.indexOf(i) >= 0;
      if (picked || o.correct) {
        lines.push(letters[i] + " (" + (picked ? "you chose" : "you missed") + ", " +
                   (o.correct ? "right" : "wrong") + "): " + o.explanation);
      }
    });
    return { correct: ok, lines: lines };
  }

  function render() {
    container.innerHTML = "";
    var state = CourseProgress.load(lesson);
    quiz.questions.forEach(function (q, n) {
      var form = el("form", { "class": "question", "data-id": q.id });
      form.appendChild(el("p", { "class": "prompt" }, (n + 1) + ". " + q.prompt));
      form.appendChild(el("p", { "class": "meta" }, q.stage + " \u00b7 " + q.section +
        (q.type === "multiple" ? " \u00b7 choose all that apply" : "")));
      if (q.type === "numeric") {
        var label = el("label");
        label.appendChild(el("input", { type: "text", inputmode: "decimal", name: q.id }));
        label.appendChild(document.createTextNode(" " + q.unit));
        form.appendChild(label);
      } else {
        q.options.forEach(function (o, i) {
          var label = el("label", { "class": "option" });
          label.appendChild(el("input", { type: q.type === "single" ? "radio" : "checkbox", name: q.id, value: String(i) }));
          label.appendChild(document.createTextNode(" " + letters[i] + ") " + o.text));
          form.appendChild(label);
        });
      }
      form.appendChild(el("button", { type: "submit" }, "Check"));
      var feedback = el("div", { "class": "feedback", "aria-live": "polite" });
      form.appendChild(feedback);
      if (state[q.id]) {
        feedback.textContent = state[q.id].correct ? "Answered: correct." : "Answered: not quite.";
        feedback.className = "feedback " + (state[q.id].correct ? "right" : "wrong");
      }
      form.addEventListener("submit", function (event) {
        event.preventDefault();
        var result = grade(q, form);
        if (!result) { feedback.textContent = "Choose an answer first."; return; }
        feedback.innerHTML = "";
        result.lines.forEach(function (line) { feedback.appendChild(el("p", {}, line)); });
        feedback.className = "feedback " + (result.correct ? "right" : "wrong");
        var current = CourseProgress.load(lesson);
        current[q.id] = { correct: result.correct };
        CourseProgress.save(lesson, current);
        updateScore();
      });
      container.appendChild(form);
    });
    updateScore();
  }

  document.getElementById("quiz-reset").addEventListener("click", function () {
    CourseProgress.reset(lesson);
    render();
  });
  render();
})();
