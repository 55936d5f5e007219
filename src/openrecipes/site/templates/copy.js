// The copy buttons of a recipe page: each copies the text of the element its data-copy names.
(function () {
  Array.prototype.forEach.call(document.querySelectorAll("button[data-copy]"), function (button) {
    button.addEventListener("click", function () {
      var text = document.getElementById(button.dataset.copy).textContent;
      function done(word) { button.textContent = word; setTimeout(function () { button.textContent = "Copy"; }, 2000); }
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(function () { done("Copied"); }, function () { done("Copy failed"); });
        return;
      }
      // a page opened from a file or over plain http has no clipboard API: select the text and copy it
      var area = document.createElement("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      var ok = false;
      try { ok = document.execCommand("copy"); } catch (error) { ok = false; }
      document.body.removeChild(area);
      done(ok ? "Copied" : "Copy failed");
    });
  });
})();
