// Quiz progress kept in localStorage: {questionId: {correct: bool}} per lesson.
var CourseProgress = (function () {
  var prefix = "dtfs-quiz-";
  function load(lesson) {
    try { return JSON.parse(localStorage.getItem(prefix + lesson) || "{}"); } catch (e) { return {}; }
  }
  function save(lesson, state) { localStorage.setItem(prefix + lesson, JSON.stringify(state)); }
  function reset(lesson) { localStorage.removeItem(prefix + lesson); }
  function summary(lesson, total) {
    var state = load(lesson), answered = 0, correct = 0;
    Object.keys(state).forEach(function (k) { answered++; if (state[k].correct) correct++; });
    return { answered: answered, correct: correct, total: total };
  }
  function showOnIndex() {
    document.querySelectorAll("[data-progress-for]").forEach(function (el) {
      var s = summary(el.dataset.progressFor, Number(el.dataset.total));
      el.textContent = s.answered ? ("quiz: " + s.answered + "/" + s.total + " answered, " + s.correct + " correct") : "not started";
    });
  }
  return { load: load, save: save, reset: reset, summary: summary, showOnIndex: showOnIndex };
})();
