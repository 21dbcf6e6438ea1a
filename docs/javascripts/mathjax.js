// attnlab's pages write math as \( ... \) and \[ ... \] inside spans of class "arithmatex"
// (pymdownx.arithmatex, generic mode); MathJax typesets those spans only.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]] },
  options: { ignoreHtmlClass: ".*", processHtmlClass: "arithmatex" },
};
