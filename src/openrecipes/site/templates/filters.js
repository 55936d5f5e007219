// Filters over the recipe rows. Options come from the cards themselves; an option that would
// match no recipe under the other current choices is disabled, so no combination is invented.
(function () {
  var keys = ["model", "gpu", "status", "workflow"];
  var rows = Array.prototype.slice.call(document.querySelectorAll("tr.recipe"));
  var count = document.getElementById("match-count");
  var none = document.getElementById("no-match");
  function select(key) { return document.getElementById("filter-" + key); }
  function matches(row, choice) {
    return keys.every(function (key) { return !choice[key] || row.dataset[key] === choice[key]; });
  }
  function current() {
    var choice = {};
    keys.forEach(function (key) { choice[key] = select(key).value; });
    return choice;
  }
  function apply() {
    var choice = current();
    var shown = 0;
    rows.forEach(function (row) {
      var ok = matches(row, choice);
      row.hidden = !ok;
      if (ok) { shown += 1; }
    });
    keys.forEach(function (key) {
      Array.prototype.forEach.call(select(key).options, function (option) {
        if (!option.value) { return; }
        var trial = Object.assign({}, choice);
        trial[key] = option.value;
        option.disabled = !rows.some(function (row) { return matches(row, trial); });
      });
    });
    count.textContent = "Showing " + shown + " of " + rows.length + " recipes";
    none.hidden = shown !== 0;
  }
  keys.forEach(function (key) { select(key).addEventListener("change", apply); });
  apply();
})();
