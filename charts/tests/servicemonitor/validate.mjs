// Validates ServiceMonitors (JSON array on stdin) with the prometheus-operator
// models' validators, generated from the ServiceMonitor CRD's schema.
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { readFileSync } from "node:fs";
for (const obj of JSON.parse(readFileSync(0, "utf8"))) {
  try { new ServiceMonitor(obj).validate(); console.log("ok   " + obj.metadata.name); }
  catch (e) { console.log("FAIL " + obj.metadata.name + ": " + e.message); process.exitCode = 1; }
}
