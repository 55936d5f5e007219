// The model page's selector. Each choice narrows the next: a select offers only the values of recorded items that
// match the choices before it, so every reachable combination is one item of the card, shown as written.
(function () {
  var keys = ["workflow", "hardware", "precision", "combination"];
  var combos = JSON.parse(document.getElementById("combinations").textContent);
  function select(key) { return document.getElementById("select-" + key); }
  function matching(upto) {
    return combos.filter(function (combo) {
      return keys.slice(0, upto).every(function (key) { return combo[key] === select(key).value; });
    });
  }
  function refresh(from) {
    for (var i = from + 1; i < keys.length; i++) {
      var allowed = matching(i).map(function (combo) { return combo[keys[i]]; });
      var chosen = select(keys[i]);
      var firstAllowed = null;
      Array.prototype.forEach.call(chosen.options, function (option) {
        option.disabled = allowed.indexOf(option.value) < 0;
        option.hidden = option.disabled;
        if (!option.disabled && firstAllowed === null) { firstAllowed = option.value; }
      });
      if (allowed.indexOf(chosen.value) < 0) { chosen.value = firstAllowed; }
    }
    var shown = matching(keys.length)[0];
    document.querySelectorAll("section.item").forEach(function (section) {
      section.hidden = !shown || section.id !== "item-" + shown.index;
    });
  }
  keys.forEach(function (key, i) { select(key).addEventListener("change", function () { refresh(i); }); });
  document.querySelectorAll("button.copy").forEach(function (button) {
    button.addEventListener("click", function () {
      var text = button.getAttribute("data-copy");
      var done = function () { button.textContent = "Copied"; };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, function () { button.textContent = "Copy failed"; });
      } else {
        var area = document.createElement("textarea");
        area.value = text;
        document.body.appendChild(area);
        area.select();
        document.execCommand("copy");
        area.remove();
        done();
      }
    });
  });
  refresh(-1);
})();
