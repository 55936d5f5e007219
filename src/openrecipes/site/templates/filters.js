// Filters and sorting over the recipe rows. Filter options come from the cards themselves; an option that would
// match no recipe under the other current choices is disabled, so no combination is invented. The choices and the
// sort order live in the address (?model=...&sort=tokens&order=desc), so a reload or a shared link shows the same
// view; a value in the address that no card holds is ignored.
(function () {
  // one filter per select of the form (the site build writes them from FILTER_LABELS)
  var keys = Array.prototype.map.call(document.querySelectorAll("form.filters select"),
                                      function (s) { return s.name; });
  var body = document.querySelector("#recipes tbody");
  var rows = Array.prototype.slice.call(body.querySelectorAll("tr.recipe"));
  var headers = Array.prototype.slice.call(document.querySelectorAll("#recipes th[data-key]"));
  var count = document.getElementById("match-count");
  var none = document.getElementById("no-match");
  var scroller = document.getElementById("recipes-scroll");
  var hint = document.getElementById("recipes-scroll-hint");
  var sort = { key: "", order: "asc" };
  function select(key) { return document.getElementById("filter-" + key); }
  function matches(row, choice) {
    return keys.every(function (key) { return !choice[key] || row.dataset[key] === choice[key]; });
  }
  function current() {
    var choice = {};
    keys.forEach(function (key) { choice[key] = select(key).value; });
    return choice;
  }
  function remember(choice) {
    var params = new URLSearchParams();
    keys.forEach(function (key) { if (choice[key]) { params.set(key, choice[key]); } });
    if (sort.key) { params.set("sort", sort.key); params.set("order", sort.order); }
    var query = params.toString();
    history.replaceState(null, "", location.pathname + (query ? "?" + query : "") + location.hash);
  }
  function cellValue(row, index, kind) {
    var text = row.cells[index].dataset.sort;
    if (kind !== "number") { return text.toLowerCase(); }
    return text === "" ? null : parseFloat(text);
  }
  function order() {
    var index = headers.findIndex(function (th) { return th.dataset.key === sort.key; });
    headers.forEach(function (th, i) {
      th.setAttribute("aria-sort", i === index ? (sort.order === "asc" ? "ascending" : "descending") : "none");
    });
    if (index < 0) { return; }
    var kind = headers[index].dataset.kind;
    var sign = sort.order === "asc" ? 1 : -1;
    var sorted = rows.slice().sort(function (a, b) {
      var x = cellValue(a, index, kind), y = cellValue(b, index, kind);
      if (x === y) { return rows.indexOf(a) - rows.indexOf(b); }  // stable: the catalog order breaks ties
      if (x === null) { return 1; }  // no value: last, in either order
      if (y === null) { return -1; }
      return (x < y ? -1 : 1) * sign;
    });
    sorted.forEach(function (row) { body.appendChild(row); });
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
    order();
    count.textContent = "Showing " + shown + " of " + rows.length + " recipes";
    none.hidden = shown !== 0;
    remember(choice);
    hintScroll();
  }
  // the hint shows only while the table is wider than its box (a narrow window, or long values in the rows shown)
  function hintScroll() { hint.hidden = scroller.scrollWidth <= scroller.clientWidth + 1; }
  window.addEventListener("resize", hintScroll);
  var params = new URLSearchParams(location.search);
  keys.forEach(function (key) {
    var wanted = params.get(key);
    if (wanted && Array.prototype.some.call(select(key).options, function (o) { return o.value === wanted; })) {
      select(key).value = wanted;
    }
  });
  if (headers.some(function (th) { return th.dataset.key === params.get("sort"); })) {
    sort.key = params.get("sort");
    sort.order = params.get("order") === "desc" ? "desc" : "asc";
  }
  headers.forEach(function (th) {
    th.querySelector("button").addEventListener("click", function () {
      // a first click sorts numbers high to low (the best throughput first) and text A to Z; a second reverses
      var first = th.dataset.kind === "number" ? "desc" : "asc";
      sort.order = sort.key === th.dataset.key ? (sort.order === "asc" ? "desc" : "asc") : first;
      sort.key = th.dataset.key;
      apply();
    });
  });
  keys.forEach(function (key) { select(key).addEventListener("change", apply); });
  apply();
})();
