"use strict";
const PALETTE=["#2f6db5","#e07b28","#3a9a4b","#c23b3b","#8a5cc2","#8c6d4f","#d66fb5","#7a7f87","#b5b02f","#2fb5b0"];
const SVGNS="http://www.w3.org/2000/svg";
function el(tag,attrs,parent){const e=document.createElementNS(SVGNS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmt(v){if(v===null||v===undefined||!isFinite(v))return "n/a";const a=Math.abs(v);
  if(a!==0&&(a>=1e6||a<1e-3))return v.toExponential(2);return +v.toPrecision(4)+"";}
function ticks(lo,hi,n){if(!(hi>lo)){hi=lo+1;}const step0=(hi-lo)/n,mag=Math.pow(10,Math.floor(Math.log10(step0)));
  const step=[1,2,5,10].map(m=>m*mag).find(s=>s>=step0);const out=[];for(let t=Math.ceil(lo/step)*step;t<=hi+1e-9*step;t+=step)out.push(t);return out;}
function legend(parent,names,colors){const d=document.createElement("div");d.className="legend";
  names.forEach((n,i)=>{const s=document.createElement("span");s.innerHTML='<i style="background:'+colors[i]+'"></i>';s.appendChild(document.createTextNode(n));d.appendChild(s);});parent.appendChild(d);}
function tip(sec){let t=sec.querySelector(".tip");if(!t){t=document.createElement("div");t.className="tip";sec.appendChild(t);}return t;}
function showTip(sec,ev,text){const t=tip(sec),r=sec.getBoundingClientRect();t.textContent=text;t.style.display="block";
  t.style.left=Math.min(ev.clientX-r.left+12,r.width-160)+"px";t.style.top=(ev.clientY-r.top+12)+"px";}
function hideTip(sec){tip(sec).style.display="none";}
function nearest(xs,x){let k=0;for(let j=1;j<xs.length;j++)if(Math.abs(xs[j]-x)<Math.abs(xs[k]-x))k=j;return k;}

function lineChart(sec,plot,d){
  const W=800,H=220,L=56,R=10,T=8,B=30;let lo=Infinity,hi=-Infinity;
  d.series.forEach(s=>s.y.forEach(v=>{if(v!==null&&isFinite(v)){lo=Math.min(lo,v);hi=Math.max(hi,v);}}));
  if(!isFinite(lo)){lo=0;hi=1;}if(hi===lo){hi=lo+Math.max(1e-9,Math.abs(lo)*0.1);lo-=(hi-lo);}
  const pad=(hi-lo)*0.05;lo-=pad;hi+=pad;let x0=Infinity,x1=-Infinity;
  [d.x].concat(d.series.map(s=>s.x||[])).forEach(xs=>xs.forEach(v=>{if(v!==null&&isFinite(v)){x0=Math.min(x0,v);x1=Math.max(x1,v);}}));
  if(!isFinite(x0)){x0=0;x1=1;}if(x1===x0)x1=x0+1;
  const sx=x=>L+(x-x0)/(x1-x0||1)*(W-L-R),sy=y=>T+(hi-y)/(hi-lo)*(H-T-B);
  const svg=el("svg",{viewBox:"0 0 "+W+" "+H},plot);let drawn=0;
  ticks(lo,hi,4).forEach(t=>{el("line",{x1:L,x2:W-R,y1:sy(t),y2:sy(t),stroke:"#eceef2"},svg);
    el("text",{x:L-4,y:sy(t)+4,"text-anchor":"end"},svg).textContent=fmt(t);});
  ticks(x0,x1,6).forEach(t=>{el("text",{x:sx(t),y:H-B+14,"text-anchor":"middle"},svg).textContent=fmt(t);});
  el("text",{x:(L+W-R)/2,y:H-2,"text-anchor":"middle"},svg).textContent=d.xLabel||"";
  el("text",{x:12,y:T+(H-T-B)/2,"text-anchor":"middle",transform:"rotate(-90 12 "+(T+(H-T-B)/2)+")"},svg).textContent=d.yLabel||"";
  (d.marks||[]).forEach(m=>{el("line",{x1:sx(m),x2:sx(m),y1:T,y2:H-B,stroke:"#c23b3b","stroke-dasharray":"3 3","stroke-opacity":0.6},svg);});
  d.series.forEach((s,i)=>{const xs=s.x||d.x,c=PALETTE[i%10];let p="",pen=false;
    s.y.forEach((v,k)=>{if(v===null||!isFinite(v)){pen=false;return;}const px=sx(xs[k]).toFixed(1),py=sy(v).toFixed(1);
      p+=(pen?"L":"M")+px+" "+py;pen=true;drawn++;if(s.x)el("circle",{cx:px,cy:py,r:3,fill:c},svg);});
    if(p)el("path",{d:p,fill:"none",stroke:c,"stroke-width":1.5},svg);});
  el("rect",{x:L,y:T,width:W-L-R,height:H-T-B,fill:"none",stroke:"#c9ced6"},svg);
  if(!drawn)el("text",{x:(L+W-R)/2,y:T+(H-T-B)/2,"text-anchor":"middle"},svg).textContent="no finite values";
  const cursor=el("line",{y1:T,y2:H-B,stroke:"#1d2230","stroke-opacity":0.3,visibility:"hidden"},svg);
  svg.addEventListener("mousemove",ev=>{const b=svg.getBoundingClientRect(),x=x0+((ev.clientX-b.left)*W/b.width-L)/(W-L-R)*(x1-x0);
    const k=nearest(d.x,x);
    cursor.setAttribute("x1",sx(d.x[k]));cursor.setAttribute("x2",sx(d.x[k]));cursor.setAttribute("visibility","visible");
    showTip(sec,ev,"step "+fmt(d.x[k])+"\n"+d.series.map(s=>{if(!s.x)return s.name+": "+fmt(s.y[k]);
      const j=nearest(s.x,x);return s.name+": "+fmt(s.y[j])+" (step "+fmt(s.x[j])+")";}).join("\n"));});
  svg.addEventListener("mouseleave",()=>{cursor.setAttribute("visibility","hidden");hideTip(sec);});
  const names=d.series.map(s=>s.name),colors=d.series.map((s,i)=>PALETTE[i%10]);
  if(d.marks&&d.marks.length){names.push(d.marksLabel||"marks");colors.push("#c23b3b");}
  legend(plot,names,colors);return drawn;}

function colorMap(){const stops=[[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]],lut=new Uint8ClampedArray(256*3);
  for(let i=0;i<256;i++){const f=i/255*(stops.length-1),k=Math.min(Math.floor(f),stops.length-2),t=f-k;
    for(let c=0;c<3;c++)lut[i*3+c]=stops[k][c]+(stops[k+1][c]-stops[k][c])*t;}return lut;}
const LUT=colorMap();
function decode(b64){const s=atob(b64),a=new Uint8Array(s.length);for(let i=0;i<s.length;i++)a[i]=s.charCodeAt(i);return a;}
function heatmap(sec,plot,d){
  const q=decode(d.q),cells=d.rows*d.cols;if(q.length!==cells*d.slices.length)throw new Error("heatmap data has "+q.length+" cells, expected "+cells*d.slices.length);
  let select=null;if(d.slices.length>1){select=document.createElement("select");
    d.slices.forEach((n,i)=>{const o=document.createElement("option");o.value=i;o.textContent=n;select.appendChild(o);});plot.appendChild(select);}
  const wrap=document.createElement("div");wrap.className="hm-wrap";plot.appendChild(wrap);
  const cv=document.createElement("canvas");cv.width=d.cols;cv.height=d.rows;wrap.appendChild(cv);
  cv.style.height=Math.max(80,Math.min(420,d.rows*Math.max(2,Math.floor(800/Math.max(d.cols,1)))))+"px";
  const yl=document.createElement("div");yl.className="hm-ylabel";yl.style.height="100%";
  yl.innerHTML='<div></div><div style="position:absolute;bottom:0;right:0"></div>';
  yl.firstChild.textContent=(d.yLabel||"")+" "+(d.rowNames&&d.rowNames.length?d.rowNames[0]:"0");
  yl.lastChild.textContent=d.rowNames&&d.rowNames.length?d.rowNames[d.rows-1]:String(d.rows-1);wrap.appendChild(yl);
  if(d.markCols&&d.markCols.length){const m=el("svg",{class:"marks",viewBox:"0 0 "+d.cols+" 100",preserveAspectRatio:"none"},wrap);
    d.markCols.forEach(c=>el("line",{x1:c+0.5,x2:c+0.5,y1:0,y2:100,stroke:"#ff3030","stroke-width":2,"stroke-opacity":0.8,"vector-effect":"non-scaling-stroke"},m));}
  const ax=document.createElement("div");ax.className="hm-x";ax.style.marginLeft="60px";
  const cn=i=>d.colNames&&d.colNames.length?d.colNames[i]:String(i),rn=i=>d.rowNames&&d.rowNames.length?d.rowNames[i]:String(i);
  [cn(0),d.xLabel||"",cn(d.cols-1)].forEach(t=>{const s=document.createElement("span");s.textContent=t;ax.appendChild(s);});plot.appendChild(ax);
  const sc=document.createElement("div");sc.className="scale";const scv=document.createElement("canvas");scv.width=256;scv.height=1;
  const sctx=scv.getContext("2d"),simg=sctx.createImageData(256,1);
  for(let i=0;i<256;i++){simg.data[i*4]=LUT[i*3];simg.data[i*4+1]=LUT[i*3+1];simg.data[i*4+2]=LUT[i*3+2];simg.data[i*4+3]=255;}
  sctx.putImageData(simg,0,0);sc.append(fmt(d.min),scv,fmt(d.max)+(d.unit?" "+d.unit:""));plot.appendChild(sc);
  const ctx=cv.getContext("2d");let slice=0;
  function draw(){const img=ctx.createImageData(d.cols,d.rows),o=slice*cells;
    for(let i=0;i<cells;i++){const v=q[o+i];img.data[i*4]=LUT[v*3];img.data[i*4+1]=LUT[v*3+1];img.data[i*4+2]=LUT[v*3+2];img.data[i*4+3]=255;}
    ctx.putImageData(img,0,0);}
  draw();if(select)select.addEventListener("change",()=>{slice=+select.value;draw();});
  cv.addEventListener("mousemove",ev=>{const b=cv.getBoundingClientRect(),c=Math.min(d.cols-1,Math.floor((ev.clientX-b.left)/b.width*d.cols)),
    r=Math.min(d.rows-1,Math.floor((ev.clientY-b.top)/b.height*d.rows)),v=d.min+q[slice*cells+r*d.cols+c]/255*(d.max-d.min);
    showTip(sec,ev,(d.yLabel||"row")+" "+rn(r)+", "+(d.xLabel||"column")+" "+cn(c)+": "+fmt(v)+(d.unit?" "+d.unit:""));});
  cv.addEventListener("mouseleave",()=>hideTip(sec));return cells;}

function bars(sec,plot,d){
  const nb=d.bars.length,np=d.parts.length,W=800,L=90,R=70,rowH=18,H=nb*rowH+24;let max=0;
  for(let b=0;b<nb;b++){let s=0;for(let p=0;p<np;p++)s+=Math.max(0,d.values[b*np+p]);max=Math.max(max,s);}if(!(max>0))max=1;
  const svg=el("svg",{viewBox:"0 0 "+W+" "+H},plot),sx=v=>v/max*(W-L-R);let drawn=0;
  ticks(0,max,5).forEach(t=>{el("line",{x1:L+sx(t),x2:L+sx(t),y1:0,y2:nb*rowH,stroke:"#eceef2"},svg);
    el("text",{x:L+sx(t),y:nb*rowH+14,"text-anchor":"middle"},svg).textContent=fmt(t);});
  for(let b=0;b<nb;b++){let x=L,sum=0;el("text",{x:L-6,y:b*rowH+13,"text-anchor":"end"},svg).textContent=d.bars[b];
    for(let p=0;p<np;p++){const v=Math.max(0,d.values[b*np+p]);sum+=v;if(v<=0)continue;
      const r=el("rect",{x:x,y:b*rowH+2,width:Math.max(0.5,sx(v)),height:rowH-4,fill:PALETTE[p%10]},svg);
      el("title",{},r).textContent=d.bars[b]+" "+d.parts[p]+": "+fmt(v)+" "+(d.unit||"");x+=sx(v);drawn++;}
    el("text",{x:x+4,y:b*rowH+13},svg).textContent=fmt(sum);}
  legend(plot,d.parts,d.parts.map((p,i)=>PALETTE[i%10]));return drawn;}

function timeline(sec,plot,d){
  const nl=d.lanes.length,W=800,L=110,R=10,rowH=14,H=nl*rowH+28,s=d.spans,ns=s.length/4;let lo=Infinity,hi=-Infinity;
  for(let i=0;i<ns;i++){lo=Math.min(lo,s[i*4+2]);hi=Math.max(hi,s[i*4+3]);}if(!isFinite(lo)){lo=0;hi=1;}if(hi<=lo)hi=lo+1;
  const svg=el("svg",{viewBox:"0 0 "+W+" "+H},plot),sx=v=>L+(v-lo)/(hi-lo)*(W-L-R);
  const color=d.names.map((n,i)=>n==="idle"?"#e4e6ea":PALETTE[i%10]);
  ticks(lo,hi,6).forEach(t=>{el("line",{x1:sx(t),x2:sx(t),y1:0,y2:nl*rowH,stroke:"#eceef2"},svg);
    el("text",{x:sx(t),y:nl*rowH+14,"text-anchor":"middle"},svg).textContent=fmt(t);});
  el("text",{x:(L+W-R)/2,y:H-2,"text-anchor":"middle"},svg).textContent=d.unit||"";
  d.lanes.forEach((n,i)=>{el("text",{x:L-6,y:i*rowH+11,"text-anchor":"end"},svg).textContent=n;});
  for(let i=0;i<ns;i++){const ln=s[i*4],k=s[i*4+1],b=s[i*4+2],e=s[i*4+3];
    const r=el("rect",{x:sx(b).toFixed(2),y:ln*rowH+1,width:Math.max(0.3,sx(e)-sx(b)).toFixed(2),height:rowH-2,fill:color[k]},svg);
    el("title",{},r).textContent=d.lanes[ln]+" "+d.names[k]+": "+fmt(b)+" to "+fmt(e)+" "+(d.unit||"");}
  legend(plot,d.names,color);return ns;}

const RENDER={line:lineChart,heatmap:heatmap,bars:bars,timeline:timeline};
function renderAll(){document.querySelectorAll("section.chart").forEach(sec=>{
  const plot=sec.querySelector(".plot");
  try{const d=JSON.parse(sec.querySelector("script.chart-data").textContent);
    sec.dataset.rendered=RENDER[sec.dataset.kind](sec,plot,d);}
  catch(e){sec.classList.add("chart-error");sec.dataset.rendered=0;plot.textContent="This chart could not be drawn: "+e.message;
    console.error("chart "+sec.id+": "+e.message);}});
  document.body.dataset.rendered="done";document.body.dataset.renderMs=performance.now().toFixed(1);}
if(document.readyState==="loading")document.addEventListener("DOMContentLoaded",renderAll);else renderAll();
